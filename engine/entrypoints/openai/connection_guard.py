"""ConnectionGuard: a cap on open connections and a header-read timeout, in front of uvicorn's HTTP protocol.

Every accepted connection goes through a small asyncio protocol that forwards to uvicorn's own. A
connection that has not sent its request headers within `header_timeout_s` is closed (slowloris holds no
file descriptor for long). Past `max_connections - reserved` open connections, a new one is on probation:
its headers are read here first and only `/health` and `/metrics` are handed on (the supervisor and a
scraper keep answering during a flood); anything else gets an immediate 503 in OpenAI's error shape, as
does any connection past `max_connections`, instead of waiting in the backlog. The cap sits below the open
file limit (`serve.raise_open_file_limit`), so accept() never fails for want of a descriptor.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

HEADER_TIMEOUT_S = 10.0
RESERVED_FOR_PROBES = 16  # connections kept for /health and /metrics once the rest are taken
MAX_HEADER_BYTES = 64 * 1024
PROBE_PATHS = (b"/health", b"/metrics")


def _refusal(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable_error", "param": None,
                                 "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class ConnectionGuard:
    """Shared by one server's connections: the limits and the counts (read by tests and the flood bench)."""

    def __init__(self, max_connections: int, reserved: int = RESERVED_FOR_PROBES,
                 header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
        assert max_connections > reserved >= 0, (max_connections, reserved)
        self.max_connections, self.reserved, self.header_timeout_s = max_connections, reserved, header_timeout_s
        self.open = 0
        self.refused = 0  # 503s given by the guard
        self.timed_out = 0  # closed for not sending their headers in time

    def protocol_factory(self, inner: Callable[..., asyncio.Protocol]) -> Callable[..., asyncio.Protocol]:
        """What uvicorn.Config(http=...) takes: called with uvicorn's protocol arguments."""
        def make(**kwargs: Any) -> asyncio.Protocol:
            return GuardedProtocol(self, lambda: inner(**kwargs))
        return make


class GuardedProtocol(asyncio.Protocol):
    def __init__(self, guard: ConnectionGuard, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self.guard, self._make_inner = guard, make_inner
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self._head = b""  # bytes up to the end of the first request's headers (kept whole only on probation)
        self._headers_done = False
        self._probation = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.guard
        guard.open += 1
        self.transport = transport
        if guard.open > guard.max_connections:
            self._refuse(f"the server holds its limit of {guard.max_connections} open connections; retry shortly")
            return
        self._timer = asyncio.get_running_loop().call_later(guard.header_timeout_s, self._header_timeout)
        self._probation = guard.open > guard.max_connections - guard.reserved
        if not self._probation:
            self._hand_over(b"")

    def _hand_over(self, buffered: bytes) -> None:
        self.inner = self._make_inner()
        self.inner.connection_made(self.transport)
        if buffered:
            self.inner.data_received(buffered)

    def _refuse(self, message: str) -> None:
        self.guard.refused += 1
        self.transport.write(_refusal(message))
        self.transport.close()

    def _header_timeout(self) -> None:
        if not self._headers_done and not self.transport.is_closing():
            self.guard.timed_out += 1
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self._headers_done:
            seen = self._head + data
            self._headers_done = b"\r\n\r\n" in seen
            self._head = seen if self._probation else seen[-3:]
            if self._headers_done and self._timer is not None:
                self._timer.cancel()
            if self._probation:
                if len(self._head) > MAX_HEADER_BYTES:
                    self._refuse("request headers are too large")
                elif self._headers_done:
                    self._decide_probation()
                return
        if self.inner is not None:
            self.inner.data_received(data)

    def _decide_probation(self) -> None:
        """Past the general cap: hand on a health or metrics probe, refuse the rest."""
        request_line = self._head.split(b"\r\n", 1)[0].split(b" ")
        path = request_line[1].split(b"?", 1)[0] if len(request_line) > 1 else b""
        if path in PROBE_PATHS:
            self._hand_over(self._head)
        else:
            self._refuse(f"the server holds {self.guard.open - 1} open connections (its limit for API requests "
                         f"is {self.guard.max_connections - self.guard.reserved}); retry shortly")
        self._head = b""

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.open -= 1
        if self._timer is not None:
            self._timer.cancel()
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
