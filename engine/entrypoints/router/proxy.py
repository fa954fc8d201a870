"""Relaying one request to an engine over httpx: SSE chunk by chunk as they arrive, anything else whole.

The client's headers go along except hop-by-hop ones and its key (the engine has its own). A stream whose
engine dies mid-way ends in-band, as the engine's own errors do: one error event in OpenAI's shape, then
`data: [DONE]`. When the client goes away, Starlette stops the relay and closing the engine response drops
the engine connection, which aborts the request there.
"""
from __future__ import annotations

from typing import AsyncIterator, Callable

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.entrypoints.openai.errors import OpenAIError, error_body
from engine.entrypoints.openai.sse import DONE, sse_event

DROPPED_HEADERS = frozenset({"host", "content-length", "authorization", "x-api-key", "connection", "keep-alive",
                             "transfer-encoding", "te", "upgrade", "accept-encoding"})  # x-api-key: Anthropic's
KEPT_RESPONSE_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "x-request-id")


def make_client() -> httpx.AsyncClient:
    """No read timeout: a stream may wait long for its first token behind other requests."""
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))


async def relay(client: httpx.AsyncClient, request: Request, url: str, body: bytes, engine_key: str,
                engine_label: str, done: Callable[[], None]) -> Response:
    """Send `body` to `url` and answer with what the engine answers; `done` runs once the response ended."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
    headers["authorization"] = f"Bearer {engine_key}"
    outgoing = client.build_request(request.method, url, content=body, headers=headers,
                                    params=request.query_params)
    try:
        upstream = await client.send(outgoing, stream=True)
    except httpx.TransportError as exc:
        done()
        raise OpenAIError(503, f"the engine of {engine_label} is not reachable: {type(exc).__name__}: {exc}",
                          code="engine_dead") from None
    out_headers = {k: upstream.headers[k] for k in KEPT_RESPONSE_HEADERS if k in upstream.headers}
    out_headers["x-pagedesk-engine"] = engine_label
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return StreamingResponse(_events(upstream, engine_label, done), status_code=upstream.status_code,
                                 headers=out_headers)
    try:
        content = await upstream.aread()
    except httpx.TransportError as exc:
        raise OpenAIError(503, f"the engine of {engine_label} stopped before answering: {type(exc).__name__}",
                          code="engine_dead") from None
    finally:
        await upstream.aclose()
        done()
    return Response(content, status_code=upstream.status_code, headers=out_headers)


async def _events(upstream: httpx.Response, engine_label: str, done: Callable[[], None]) -> AsyncIterator[bytes]:
    tail = b"\n\n"
    try:
        async for chunk in upstream.aiter_raw():
            if chunk:
                tail = chunk[-2:]
                yield chunk
    except httpx.TransportError as exc:
        cut = b"" if tail == b"\n\n" else b"\n\n"  # end a half-sent event before ours
        message = f"the engine of {engine_label} stopped mid-stream ({type(exc).__name__}); the router restarts it"
        yield cut + sse_event(error_body(503, message, None, "engine_dead")).encode() + DONE.encode()
    finally:
        await upstream.aclose()
        done()
