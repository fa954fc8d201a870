"""AsyncEngine: runs the (not thread-safe) LLMEngine in one background thread and serves asyncio callers.

The engine thread loads the model, then loops: take queued commands (add, abort, call), run one
`step()`, hand each RequestOutput to its request's asyncio queue via `loop.call_soon_threadsafe`. The
event loop never touches the LLMEngine. An exception in `step()` marks the engine dead: every
in-flight request gets `EngineDeadError`, new requests are refused, and `status` says why; the thread
never dies silently. A caller that goes away closes its `RequestStream`, which aborts the request at
once so its blocks are freed.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.config import EngineConfig
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger("pagedesk.engine")

IDLE_WAIT_S = 0.25  # how long an idle engine thread blocks on its command queue
STATS_EVERY_S = 0.1
RATE_WINDOW_S = 2.0


class EngineNotReadyError(RuntimeError):
    """The model is still loading."""


class EngineDeadError(RuntimeError):
    """The engine failed (at load or in a step) and serves nothing more."""


_ACCEPTED = object()  # first item on a request's queue once the engine took it


@dataclass
class _Add:
    request_id: str
    prompt: list[int] | str
    params: SamplingParams
    stream: "RequestStream"
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class _Stop:
    pass


@dataclass
class RequestStream:
    """One request's outputs as they arrive; iterate it, and `close()` it when done (aborts if unfinished)."""

    request_id: str
    engine: "AsyncEngine"
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    closed: bool = False

    def put_threadsafe(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self.finished:
                self.engine.abort(self.request_id)


class AsyncEngine:
    """Owns the engine thread; every public method is safe to call from the event loop."""

    def __init__(self, config: EngineConfig, engine_factory: Callable[[EngineConfig], Any] | None = None):
        self.config = config
        self._engine_factory = engine_factory
        self.engine: Any = None  # the LLMEngine, once loaded; only the engine thread calls into it
        self.status = "loading"  # loading | ready | dead | stopped
        self.error: str | None = None
        self.load_error: BaseException | None = None
        self.load_seconds: float | None = None
        self.ready_event = threading.Event()  # set when loaded or failed
        self.stats = EngineStats()
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._rate_samples: collections.deque = collections.deque()
        self._last_stats_time = 0.0
        self._thread = threading.Thread(target=self._run, name="pagedesk-engine", daemon=True)

    # ---- event-loop side ----

    def start(self) -> None:
        self._thread.start()

    def wait_until_loaded(self, timeout: float | None = None) -> bool:
        return self.ready_event.wait(timeout)

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def check_serving(self) -> None:
        if self.status == "loading":
            raise EngineNotReadyError("the model is still loading; retry when GET /health returns 200")
        if self.status != "ready":
            raise EngineDeadError(f"the engine is not running ({self.status}): {self.error}")

    async def add_request(self, request_id: str, prompt: list[int] | str, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it; raises ValueError if it refused it."""
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        with self._lock:
            self.check_serving()
            self._commands.put(_Add(request_id, prompt, params, stream, arrival_time or time.time()))
        try:
            item = await stream.queue.get()
        except BaseException:
            stream.close()
            raise
        if isinstance(item, BaseException):
            stream.finished = stream.closed = True
            raise item
        assert item is _ACCEPTED
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored)."""
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(llm_engine) on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self.check_serving()
            self._commands.put(_Call(fn, loop, future))
        return await future

    def token_rates(self) -> tuple[float, float]:
        """(prompt tokens/s, generation tokens/s) over the last ~2 s."""
        samples = list(self._rate_samples)
        if len(samples) < 2:
            return 0.0, 0.0
        (t0, p0, g0), (t1, p1, g1) = samples[0], samples[-1]
        dt = max(t1 - t0, 1e-6)
        return (p1 - p0) / dt, (g1 - g0) / dt

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.status in ("loading", "ready"):
            self.status = "stopped"

    # ---- engine thread ----

    def _run(self) -> None:
        if not self._load():
            return
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the thread must report every way it can end
            self._die(exc)
        finally:
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001
                log.exception("engine shutdown failed")

    def _load(self) -> bool:
        start = time.perf_counter()
        try:
            factory = self._engine_factory
            if factory is None:
                from engine.llm_engine import LLMEngine
                factory = LLMEngine
            self.engine = factory(self.config)
        except BaseException as exc:  # noqa: BLE001 - reported to serve.main, which exits with a code
            self.load_error = exc
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = "dead"
            self.ready_event.set()
            return False
        self.load_seconds = time.perf_counter() - start
        self._sample_stats(force=True)
        self.status = "ready"
        self.ready_event.set()
        return True

    def _loop(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if not self._drain_commands(block=not busy):
                return
            try:
                if engine.has_unfinished_requests():
                    self._dispatch(engine.step())
                elif not busy:
                    engine.check_health()  # a worker that died while we sat idle fails now, not at the next request
            except Exception as exc:  # noqa: BLE001
                self._die(exc)
                return
            self._sample_stats()

    def _drain_commands(self, block: bool) -> bool:
        """Handle queued commands; returns False on stop."""
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                with self._lock:
                    self.status = "stopped"
                    self.error = "the server is shutting down"
                self._fail_all(EngineDeadError("the server is shutting down"))
                return False
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, cmd: object) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Abort):
            self._abort(cmd.request_id)
        elif isinstance(cmd, _Call):
            try:
                result, error = cmd.fn(self.engine), None
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                result, error = None, exc
            cmd.loop.call_soon_threadsafe(_resolve, cmd.future, result, error)

    def _add(self, cmd: _Add) -> None:
        if cmd.request_id in self._streams:
            cmd.stream.put_threadsafe(ValueError(f"request id {cmd.request_id!r} is already in use"))
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time)
        except Exception as exc:  # noqa: BLE001 - ValueError becomes a 400; anything else is reported
            cmd.stream.put_threadsafe(exc)
            return
        self._streams[cmd.request_id] = cmd.stream
        cmd.stream.put_threadsafe(_ACCEPTED)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - an abort that fails must not take serving down
            log.exception("abort of %s failed", request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put_threadsafe(out)

    def _sample_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_time < STATS_EVERY_S:
            return
        self._last_stats_time = now
        self.stats = self.engine.get_stats()
        self._rate_samples.append((now, self.stats.prompt_tokens_total, self.stats.generation_tokens_total))
        while len(self._rate_samples) > 2 and now - self._rate_samples[1][0] >= RATE_WINDOW_S:
            self._rate_samples.popleft()

    def _die(self, exc: BaseException) -> None:
        log.error("engine step failed; the engine is dead:\n%s",
                  "".join(traceback.format_exception(exc)))
        error = EngineDeadError(f"the engine failed and stopped serving: {type(exc).__name__}: {exc}")
        with self._lock:
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = "dead"
        self._fail_all(error)

    def _fail_all(self, error: EngineDeadError) -> None:
        """Fail every in-flight request and every command still queued."""
        for stream in self._streams.values():
            stream.put_threadsafe(error)
        self._streams.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.stream.put_threadsafe(error)
            elif isinstance(cmd, _Call):
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, error)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
