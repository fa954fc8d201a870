"""Bearer-token check for every route but the open ones, when the server runs with --api-key.

It runs as ASGI middleware, before routing and before the body is read or parsed, so a client without
the key learns nothing from the server but "401" (not even whether its JSON was valid). Open without a
key, on purpose: /health (supervisors), /metrics (scrapers; model name and counters only), and the
API's own description (/openapi.json, /docs, /redoc: the schema of the routes, never data). The token
(a bearer token, or Anthropic's `x-api-key` header) is compared in constant time (`hmac.compare_digest`),
so response timing says nothing about how much of a guess was right.
"""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.entrypoints.openai.errors import error_response_for

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def bearer_token(headers: dict[bytes, bytes]) -> str:
    header = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def request_key(headers: dict[bytes, bytes]) -> str:
    """The key a client sent: `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key` (Anthropic's)."""
    return bearer_token(headers) or headers.get(b"x-api-key", b"").decode("latin-1").strip()


def key_matches(token: str, api_key: str) -> bool:
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), api_key.encode("utf-8"))


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is None or scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if key_matches(request_key(dict(scope.get("headers") or [])), self.api_key):
            await self.app(scope, receive, send)
            return
        response = error_response_for(scope.get("path", ""), 401, "Incorrect or missing API key: send it as "
                                      "'Authorization: Bearer <key>' or 'x-api-key: <key>'", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
