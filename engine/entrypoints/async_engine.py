"""AsyncEngine: runs the (not thread-safe) LLMEngine in one background thread and serves asyncio callers.

The engine thread loads the model, then loops: take queued commands (add, abort, call), run one
`step()`, hand each RequestOutput to its request's stream via `loop.call_soon_threadsafe`. The
event loop never touches the LLMEngine. A request the engine failed on its own (request_faults.py) gets
`RequestFailedError` on its stream and nothing else changes; an exception out of `step()` (the batch, the
device, a worker) marks the engine dead: every
in-flight request gets `EngineDeadError`, new requests are refused, and `status` says why; the thread
never dies silently. The step watchdog (engine/core/step_watchdog.py: `--step-timeout`, and the tensor-parallel
workers' heartbeat) declares a step that never returns, or a worker that stopped beating, dead the same
way, and the workers are ended so a collective stuck on one of them fails. A caller that goes away closes
its `RequestStream`, which aborts the request at once so its blocks are freed. A caller that stays but
stops reading (a client that stopped reading its socket, so the route blocks on the send) leaves outputs
unread: its request is paused (not scheduled, blocks kept) until it reads, and aborted after
`--stream-idle-timeout` seconds unread.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from engine.core.beam_search import BeamSearchParams
from engine.config.flags import EngineConfig
from engine.core.outputs import EngineStats, RequestOutput
from engine.sample.sampling_params import SamplingParams
from engine.core.step_watchdog import StepWatchdog, resolve_step_timeout
from engine.entrypoints.exceptions import EngineDeadError, EngineNotReadyError, RequestFailedError, StreamIdleTimeout

if TYPE_CHECKING:
    from engine.sample.pooling import PoolingParams

log = logging.getLogger("pagedesk.engine")

IDLE_WAIT_S = 0.25  # how long an idle engine thread blocks on its command queue
STATS_EVERY_S = 0.1
# A reader this many outputs behind is not reading (one or two behind is the event loop catching up): its
# request is paused until it reads.
MAX_UNREAD_OUTPUTS = 4
RATE_WINDOW_S = 2.0


_ACCEPTED = object()  # handed to a request's stream once the engine took it


@dataclass
class _Add:
    request_id: str
    prompt: list[int] | str
    params: SamplingParams
    stream: "RequestStream"
    arrival_time: float
    cache_salt: str | None = None
    beam: BeamSearchParams | None = None  # a beam search instead of sampling
    priority: int = 0
    pooling: PoolingParams | None = None  # an embedding request instead of sampling
    mm: Any = None  # its images (engine/multimodal/inputs.MultiModalInputs), processed by the caller


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    refresh_stats: bool = False


class _Stop:
    pass


class _Wake:
    """Nothing to do: wakes an engine thread that waits on its queue (a paused reader read again)."""


class RequestStream:
    """One request's outputs as they arrive; iterate it, and `close()` it when done (aborts if unfinished).

    Outputs are cumulative, so the stream holds only the newest one: a reader that falls behind (a client
    that stops reading) gets the latest state when it reads again, and memory stays one output per
    request, not one per step. An error replaces whatever was pending; `close()` drops it.
    """

    def __init__(self, request_id: str, engine: "AsyncEngine", loop: asyncio.AbstractEventLoop):
        self.request_id, self.engine, self.loop = request_id, engine, loop
        self.accepted: asyncio.Future = loop.create_future()
        self.finished = False
        self.closed = False
        self._pending: object = None  # newest RequestOutput or an exception, not yet read
        self._ready = asyncio.Event()
        # Reader bookkeeping, written by the engine thread when it hands an output and reset by the reader
        # (plain attribute writes: a race costs at most one extra step or one late pause).
        self.unread = 0  # outputs handed since the reader last took one
        self.unread_since: float | None = None  # monotonic time the oldest unread output was handed
        self.paused = False  # the engine paused the request because of unread outputs

    def put_threadsafe(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.put, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def put(self, item: object) -> None:
        """On the stream's event loop (`put_threadsafe` from any other thread): the newest output, or an error."""
        if not self.accepted.done():
            if item is _ACCEPTED:
                self.accepted.set_result(None)
            elif isinstance(item, BaseException) and not self.closed:  # a closed caller no longer awaits it
                self.accepted.set_exception(item)
            return
        if self.closed or isinstance(self._pending, BaseException):
            return
        self._pending = item
        self._ready.set()

    def pending_output(self) -> object:
        """What the next read returns without waiting (None if nothing arrived since the last read)."""
        return self._pending

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        self.unread, self.unread_since = 0, None
        if self.paused:
            self.engine.wake()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._pending = None
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
        self.watchdog = StepWatchdog()  # its step timeout is set once loaded, when the device is known

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
                          arrival_time: float | None = None, cache_salt: str | None = None,
                          beam: BeamSearchParams | None = None, priority: int = 0,
                          pooling: PoolingParams | None = None, mm: Any = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it; raises ValueError if it refused it."""
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        with self._lock:
            self.check_serving()
            self._commands.put(_Add(request_id, prompt, params, stream, arrival_time or time.time(), cache_salt,
                                    beam, priority, pooling, mm))
        try:
            await asyncio.shield(stream.accepted)
        except asyncio.CancelledError:
            stream.close()
            raise
        except BaseException:
            stream.finished = stream.closed = True
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored)."""
        self._commands.put(_Abort(request_id))

    def wake(self) -> None:
        self._commands.put(_Wake())

    async def call(self, fn: Callable[[Any], Any], refresh_stats: bool = False) -> Any:
        """Run fn(llm_engine) on the engine thread between steps and return its result; `refresh_stats` for a call
        that changes what the stats say (a sleep, a wake), so /metrics shows it at once, not at the next tick."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self.check_serving()
            self._commands.put(_Call(fn, loop, future, refresh_stats))
        return await future

    def token_rates(self) -> tuple[float, float]:
        """(prompt tokens/s, generation tokens/s) over the last ~2 s."""
        samples = list(self._rate_samples)
        if len(samples) < 2:
            return 0.0, 0.0
        (t0, p0, g0), (t1, p1, g1) = samples[0], samples[-1]
        dt = max(t1 - t0, 1e-6)
        return (p1 - p0) / dt, (g1 - g0) / dt

    def stop_serving(self) -> None:
        """Begin a shutdown without waiting (safe in a signal handler): every stream ends with an error event.

        The streams are told here, not when the engine thread next reads its commands: that thread may be
        inside a step for longer than the server's graceful shutdown lasts (a tensor-parallel step waiting on
        its workers, a long prefill), and a stream still open then is cut instead of ended in-band. No lock:
        a signal handler runs on the event-loop thread, which may hold `_lock` (add_request) at that moment.
        The engine thread fails them again on the _Stop; a stream keeps the first error it got."""
        error = EngineDeadError("the server is shutting down")
        for stream in list(self._streams.values()):  # a snapshot: the engine thread may be adding or removing
            stream.put_threadsafe(error)
        self._commands.put(_Stop())

    def shutdown(self, timeout: float = 10.0) -> None:
        self.watchdog.stop()
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
                from engine.entrypoints.llm_engine import LLMEngine
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
        self.watchdog.step_timeout = resolve_step_timeout(getattr(self.config, "step_timeout", None),
                                                          getattr(self.engine, "device", None))
        self.status = "ready"
        self.ready_event.set()
        liveness = getattr(getattr(self.engine, "runner", None), "liveness_problem", None)  # tensor parallel only
        self.watchdog.start(liveness, lambda: self.status == "ready", self._declare_stuck)
        return True

    def _loop(self) -> None:
        engine = self.engine
        idle_step = False
        while True:
            busy = engine.has_unfinished_requests()
            # A step that ran nothing (every running request paused or compiling): wait for a command or a read.
            if not self._drain_commands(block=not busy or idle_step):
                return
            self._watch_readers(time.monotonic())
            if self.status != "ready":  # the watchdog gave up on a step that then returned after all
                self._fail_all(EngineDeadError(f"the engine stopped serving: {self.error}"))
                return
            try:
                idle_step = False
                if engine.has_unfinished_requests():
                    self.watchdog.step_started()
                    steps_before = getattr(getattr(engine, "stats", None), "num_steps", None)
                    outputs = engine.step()
                    self.watchdog.step_ended()
                    self._dispatch(outputs)
                    idle_step = (not outputs and steps_before is not None and engine.stats.num_steps == steps_before
                                 and not getattr(engine, "compiling", None)  # compiles: step() polls them
                                 and not getattr(engine, "loading_kv", False))  # tier copies: step() waits for them
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

    def _watch_readers(self, now: float) -> None:
        """Pause the requests whose reader left MAX_UNREAD_OUTPUTS outputs unread (resume them once it reads);
        abort those unread for longer than --stream-idle-timeout."""
        timeout = getattr(self.config, "stream_idle_timeout", 0) or 0
        for request_id, stream in list(self._streams.items()):
            if timeout and stream.unread_since is not None and now - stream.unread_since > timeout:
                self._abort(request_id)
                stream.put_threadsafe(StreamIdleTimeout(
                    f"the client left this request's output unread for over {timeout:g} s "
                    "(--stream-idle-timeout): the request was aborted and its KV blocks freed"))
                continue
            stalled = stream.unread >= MAX_UNREAD_OUTPUTS
            if stalled != stream.paused:
                stream.paused = stalled
                pause = getattr(self.engine, "pause_request", None)
                if pause is not None:
                    pause(request_id, stalled)

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
            if cmd.refresh_stats:
                self._sample_stats(force=True)
            cmd.loop.call_soon_threadsafe(_resolve, cmd.future, result, error)

    def _add(self, cmd: _Add) -> None:
        if cmd.stream.closed:  # the caller left before the engine took it: its abort came first
            return
        if cmd.request_id in self._streams:
            cmd.stream.put_threadsafe(ValueError(f"request id {cmd.request_id!r} is already in use"))
            return
        try:
            if cmd.beam is not None:
                self.engine.add_beam_request(cmd.request_id, cmd.prompt, cmd.beam, cmd.arrival_time, cmd.cache_salt,
                                             cmd.priority, **({"mm": cmd.mm} if cmd.mm is not None else {}))
            else:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                        cache_salt=cmd.cache_salt, priority=cmd.priority, pooling=cmd.pooling,
                                        **({"mm": cmd.mm} if cmd.mm is not None else {}))
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
        """A step's outputs to their streams, in one event-loop callback per loop: each cross-thread call wakes
        the loop (a write to its self-pipe), and a wake-up is a GIL hand-over in the middle of the next step."""
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            else:
                stream.unread += 1
                if stream.unread_since is None:
                    stream.unread_since = time.monotonic()
            error = getattr(out, "error", None)
            item = out if error is None else RequestFailedError(error)
            deliveries.setdefault(stream.loop, []).append((stream, item))
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _sample_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_time < STATS_EVERY_S:
            return
        self._last_stats_time = now
        self.stats = self.engine.get_stats()
        self._rate_samples.append((now, self.stats.prompt_tokens_total, self.stats.generation_tokens_total))
        while len(self._rate_samples) > 2 and now - self._rate_samples[1][0] >= RATE_WINDOW_S:
            self._rate_samples.popleft()

    def _declare_stuck(self, message: str) -> None:
        """Watchdog thread: the engine thread is stuck inside step(), or a worker stopped; fail everything
        without the engine thread's help."""
        log.error(message)
        with self._lock:
            if self.status != "ready":
                return
            self.error, self.status = message, "dead"
        error = EngineDeadError(f"the engine stopped serving: {message}")
        for stream in list(self._streams.values()):  # the engine thread is inside step(), not touching these
            stream.put_threadsafe(error)
        # A collective waiting on a stuck worker only returns once that worker is gone.
        kill_workers = getattr(getattr(self.engine, "runner", None), "kill_workers", None)
        if kill_workers is not None:
            kill_workers()

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            stuck = self.status == "dead"  # the watchdog already declared it (and said why)
            if not stuck:
                self.error = f"{type(exc).__name__}: {exc}"
                self.status = "dead"
        if stuck:
            log.error("the stuck engine step ended: %s: %s", type(exc).__name__, exc)
        else:
            log.error("engine step failed; the engine is dead:\n%s", "".join(traceback.format_exception(exc)))
        self._fail_all(EngineDeadError(f"the engine failed and stopped serving: {self.error}"))

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


def _deliver(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream.put(item)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
