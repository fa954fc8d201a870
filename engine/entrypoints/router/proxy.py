"""Relaying one request to an engine over httpx: SSE chunk by chunk as they arrive, anything else whole.

The client's headers go along except hop-by-hop ones and its key (the engine has its own). A stream whose
engine dies mid-way ends in-band, as the engine's own errors do: one error event in OpenAI's shape, then
`data: [DONE]`. When the client goes away, Starlette stops the relay and closing the engine response drops
the engine connection, which aborts the request there. Each engine's relays in flight are registered in its
`Relays`, so the router can cut them with a reason of its own (the model was unloaded, the engine stopped
answering): the client then reads that reason, in-band or as a 503, instead of whatever the engine's end
looks like from here; and an unload can wait until the requests (not the engine-state watchers) are done.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
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


@dataclass(eq=False)
class Relay:
    """One request in flight to an engine; `cut` ends it with the router's reason."""

    is_request: bool  # a POST (generation); False for a GET (an engine-state stream, a stored response)
    reason: str | None = None
    code: str | None = None
    sending: asyncio.Future | None = None  # waiting for the engine's headers
    upstream: httpx.Response | None = None  # reading the engine's body

    def cut(self, reason: str, code: str) -> None:
        if self.reason is not None:
            return
        self.reason, self.code = reason, code
        if self.sending is not None and not self.sending.done():
            self.sending.cancel()
        if self.upstream is not None:  # the reader then gets a ReadError at once
            asyncio.ensure_future(self.upstream.aclose())


class Relays:
    """The relays in flight to one engine."""

    def __init__(self) -> None:
        self._open: set[Relay] = set()
        self._no_requests = asyncio.Event()
        self._no_requests.set()

    def open(self, is_request: bool) -> Relay:
        relay = Relay(is_request)
        self._open.add(relay)
        if is_request:
            self._no_requests.clear()
        return relay

    def close(self, relay: Relay) -> None:
        self._open.discard(relay)
        if not any(r.is_request for r in self._open):
            self._no_requests.set()

    @property
    def num_requests(self) -> int:
        return sum(r.is_request for r in self._open)

    async def requests_done(self) -> None:
        """Returns once no request (GETs aside) is in flight."""
        await self._no_requests.wait()

    def cut(self, reason: str, code: str) -> int:
        """Cut every relay in flight (their clients read `reason`); how many there were."""
        relays = list(self._open)
        for relay in relays:
            relay.cut(reason, code)
        return len(relays)


async def relay(client: httpx.AsyncClient, request: Request, url: str, body: bytes, engine_key: str,
                engine_label: str, done: Callable[[], None], relays: Relays) -> Response:
    """Send `body` to `url` and answer with what the engine answers; `done` runs once the response ended."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
    headers["authorization"] = f"Bearer {engine_key}"
    outgoing = client.build_request(request.method, url, content=body, headers=headers,
                                    params=request.query_params)
    handle = relays.open(request.method != "GET")

    def finish() -> None:
        relays.close(handle)
        done()

    handle.sending = asyncio.ensure_future(client.send(outgoing, stream=True))
    try:
        upstream = await handle.sending
    except (httpx.TransportError, asyncio.CancelledError) as exc:
        finish()
        cancelled_here = asyncio.current_task().cancelling() if asyncio.current_task() else 0
        if handle.reason is not None and not cancelled_here:
            raise OpenAIError(503, handle.reason, code=handle.code) from None
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise OpenAIError(503, f"the engine of {engine_label} is not reachable: {type(exc).__name__}: {exc}",
                          code="engine_dead") from None
    handle.sending, handle.upstream = None, upstream
    if handle.reason is not None:  # cut between the headers' arrival and now: the reads below end at once
        await upstream.aclose()
    out_headers = {k: upstream.headers[k] for k in KEPT_RESPONSE_HEADERS if k in upstream.headers}
    out_headers["x-pagedesk-engine"] = engine_label
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return StreamingResponse(_events(upstream, engine_label, finish, handle), status_code=upstream.status_code,
                                 headers=out_headers)
    try:
        content = await upstream.aread()
    except (httpx.TransportError, httpx.StreamError) as exc:  # StreamError: closed by a cut between reads
        raise OpenAIError(503, handle.reason or f"the engine of {engine_label} stopped before answering: "
                          f"{type(exc).__name__}", code=handle.code or "engine_dead") from None
    finally:
        await upstream.aclose()
        finish()
    return Response(content, status_code=upstream.status_code, headers=out_headers)


async def _events(upstream: httpx.Response, engine_label: str, done: Callable[[], None],
                  handle: Relay) -> AsyncIterator[bytes]:
    tail = b"\n\n"
    try:
        async for chunk in upstream.aiter_raw():
            if handle.reason is not None:  # cut: what the engine sent since (read from the buffer) is not relayed
                raise httpx.StreamClosed()
            if chunk:
                tail = chunk[-2:]
                yield chunk
    except (httpx.TransportError, httpx.StreamError) as exc:  # StreamError: closed by a cut between reads
        cut = b"" if tail == b"\n\n" else b"\n\n"  # end a half-sent event before ours
        message = handle.reason or \
            f"the engine of {engine_label} stopped mid-stream ({type(exc).__name__}); the router restarts it"
        yield cut + sse_event(error_body(503, message, None, handle.code or "engine_dead")).encode() + DONE.encode()
    finally:
        await upstream.aclose()
        done()
