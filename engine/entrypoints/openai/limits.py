"""BodyLimitMiddleware: refuse request bodies over a size limit with a 413 in OpenAI's error shape.

A declared Content-Length over the limit is refused before reading; a chunked body that grows past
it stops being read, and the route then fails to parse it (a 400).
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.entrypoints.openai.errors import error_response

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_body_bytes = app, max_body_bytes

    def _refusal(self):
        return error_response(413, f"request body is larger than the {self.max_body_bytes} byte limit",
                              code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refusal()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(f"request body is larger than the {self.max_body_bytes} byte limit")
            return message

        await self.app(scope, limited_receive, send)
