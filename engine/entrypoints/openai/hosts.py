"""TrustedHostMiddleware: answer only requests whose Host header names this server (DNS rebinding defence).

A web page on attacker.example can point its own DNS name at 127.0.0.1 and then talk to a local server
from the victim's browser; the browser still sends `Host: attacker.example`. So the server answers only
the names it is known by: the localhost names, the address it binds, and whatever `--allowed-hosts`
adds ('*' turns the check off, e.g. behind a reverse proxy that rewrites Host). Binding a wildcard
address (0.0.0.0, ::) without `--allowed-hosts` means "reachable under any name", so nothing is checked.
Refusals are 400 in OpenAI's error shape, before any route (or the API key check) runs.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.entrypoints.openai.errors import error_response

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def allowed_host_names(bind_host: str, allowed_hosts: str | None) -> frozenset[str] | None:
    """The Host names to answer (lowercase, no port), or None for "any"."""
    extra = [h.strip().lower() for h in (allowed_hosts or "").split(",") if h.strip()]
    if "*" in extra or (not extra and bind_host.strip() in WILDCARD_BINDS):
        return None
    return frozenset([*LOCAL_NAMES, bind_host.strip().lower().strip("[]"), *extra])


def host_name(header: str) -> str:
    """'Example.com:8000' → 'example.com'; '[::1]:8000' → '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    if header.count(":") > 1:  # a bare IPv6 address (no port without brackets)
        return header
    name, _, port = header.rpartition(":")
    return name if name and port.isdigit() else header


class TrustedHostMiddleware:
    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        if host_name(header) in self.allowed:
            await self.app(scope, receive, send)
            return
        response = error_response(400, f"Host header {header[:100]!r} is not a name of this server; start it with "
                                       "--allowed-hosts NAME to serve under that name", code="invalid_host")
        await response(scope, receive, send)
