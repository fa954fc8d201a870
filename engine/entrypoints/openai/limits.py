"""BodyLimitMiddleware: refuse a request body over the size limit, or of a JSON shape past the limits, before
anything parses it.

A declared Content-Length over the size limit is refused before reading, a body that grows past it while it
is read (chunked) as soon as it does: a 413. A body may then hold at most MAX_JSON_NODES objects, arrays and
keys together and nest at most MAX_JSON_DEPTH deep, else it is a 400 naming the limit, before a JSON parser
builds a single object: a 4 MiB body of 330k tiny keys once held the event loop for over a second (parsing,
then validating), delaying every other client. The shape is read from the raw bytes: first C-speed bounds
(the counts of '{', '[' and ':' bound it from above; the '":' that end keys bound the keys from below, which
refuses the usual flood of keys at once), and only a body between them is scanned token by token (each
string skipped by one regular expression), a large one in a worker thread of its own, where the scan, being
Python, lets the event loop run every few milliseconds. What passes costs a bounded time to parse and validate; that
work stays on the event loop, since the C JSON parser and pydantic hold the interpreter lock and a thread
would not free the loop while they run. Refusals have the route's error shape (Anthropic's under /v1/messages).
"""
from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.entrypoints.openai.errors import error_response_for

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_JSON_NODES = 50_000  # objects, arrays and keys: an agent's long session with its tools holds ~10k
MAX_JSON_DEPTH = 128  # a tool's JSON schema may nest 64 deep (the grammar's limit) inside the body
SCAN_OFF_LOOP_BYTES = 64 * 1024  # a larger body's shape is scanned in the worker thread

_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]:]', re.DOTALL)
_OPEN, _CLOSE, _QUOTE = frozenset(b"{["), frozenset(b"}]"), ord('"')
_scanner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedesk-body-scan")  # a burst queues on itself


def json_shape_problem(raw: bytes) -> str | None:
    """Why a JSON body is past the shape limits (the message a client reads), None when it is within them;
    counted without parsing (an invalid body is left to the parser's own error)."""
    opens = raw.count(b"{") + raw.count(b"[")
    if opens + raw.count(b":") <= MAX_JSON_NODES and opens <= MAX_JSON_DEPTH:
        return None  # upper bounds: the bytes inside strings are counted too
    if _keys_at_least(raw) > MAX_JSON_NODES:
        return _too_many_nodes()
    nodes = depth = 0
    for match in _TOKEN.finditer(raw):
        byte = raw[match.start()]
        if byte == _QUOTE:
            continue
        if byte in _OPEN:
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return f"request body nests deeper than {MAX_JSON_DEPTH} levels (the limit)"
        elif byte in _CLOSE:
            depth -= 1
            continue
        nodes += 1
        if nodes > MAX_JSON_NODES:
            return _too_many_nodes()
    return None


def _keys_at_least(raw: bytes) -> int:
    """A lower bound on the keys: '":' whose quote ends a key. A quote inside a string is escaped (after a
    backslash) and an opening quote follows '{', '[', ',', ':' or whitespace; a '":' after none of these ends a
    key (a key that itself ends in one of them is missed: a bound from below)."""
    return raw.count(b'":') - sum(raw.count(bytes([before]) + b'":') for before in b'\\{[,: \t\r\n')


def _too_many_nodes() -> str:
    return f"request body holds more than {MAX_JSON_NODES} JSON objects, arrays and keys (the limit); send fewer"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_body_bytes = app, max_body_bytes

    def _too_large(self, scope: Scope):
        return error_response_for(scope.get("path", ""), 413, f"request body is larger than the "
                                  f"{self.max_body_bytes} byte limit", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope)(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was in: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(scope)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = json_shape_problem(body) if len(body) < SCAN_OFF_LOOP_BYTES else \
            await asyncio.get_running_loop().run_in_executor(_scanner, json_shape_problem, body)
        if problem is not None:
            await error_response_for(scope.get("path", ""), 400, problem, code="request_too_complex")(
                scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the client's disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
