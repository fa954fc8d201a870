"""Bearer-token check for /v1 routes, /tokenize and /detokenize when the server runs with --api-key.

The token is compared in constant time (`hmac.compare_digest`), so response timing says nothing about
how much of a guess was right. /health and /metrics stay open for supervisors and scrapers.
"""
from __future__ import annotations

import hmac

from fastapi import Depends, Request

from engine.server.context import ServerContext, get_context
from engine.server.errors import OpenAIError


def _bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def require_api_key(request: Request, ctx: ServerContext = Depends(get_context)) -> None:
    if ctx.api_key is None:
        return
    token = _bearer_token(request)
    if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), ctx.api_key.encode("utf-8")):
        raise OpenAIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                          code="invalid_api_key")
