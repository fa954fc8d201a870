"""Runs one serving benchmark (engine.bench.serve_load) in its own QThread and reports through signals.

`BenchmarkWorker.run` first builds the requests when it was given a builder instead of a list (the prompts
are counted by the server's tokenizer: network work, so it happens here, reported as `preparing(done,
total)`), then drives the load with asyncio inside the thread; every finished request is emitted
as `outcome` (the GUI draws live plots from those), and the end as `finished(BenchmarkResult)` or
`failed(message)`, a sentence (`failure_words`). `stop()` ends the schedule early: requests not yet sent are
skipped, those in flight finish. The GUI thread never waits on the network.
"""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from typing import Callable, Union

import httpx

import numpy as np
from PySide6.QtCore import QObject, Qt, QThread, Signal

from engine.bench.serve_client import RequestOutcome
from engine.bench.serve_dataset import ServeRequest
from engine.bench.serve_load import ServeLoad, run_load
from engine.bench.serve_metrics import ServeSummary, summarize

CURVE_PERCENTILES = np.arange(1, 100)
Progress = Callable[[int, int], None]
Requests = Union[list[ServeRequest], Callable[[Progress], list[ServeRequest]]]  # a list, or its builder


@dataclass(frozen=True, slots=True)
class BenchmarkResult:
    summary: ServeSummary
    curves: dict  # {"percentiles", "ttft_ms", "itl_ms": 1..99th percentiles; "timeline": [[done_s, ttft_ms, tpot_ms]]}
    stopped_early: bool


def latency_curves(outcomes: list[RequestOutcome]) -> dict:
    """What the past-runs overlay draws: TTFT and ITL at percentiles 1..99, and when each request finished."""
    ok = [o for o in outcomes if o.ok]
    ttft = np.array([o.ttft for o in ok]) * 1e3
    itl = np.concatenate([np.asarray(o.itls) for o in ok]) * 1e3 if ok else np.empty(0)
    t0 = min((o.start for o in ok), default=0.0)
    timeline = [[o.start + o.e2e - t0, o.ttft * 1e3, 1e3 * (o.e2e - o.ttft) / max(o.output_tokens - 1, 1)]
                for o in ok]
    return {"percentiles": CURVE_PERCENTILES.tolist(),
            "ttft_ms": np.percentile(ttft, CURVE_PERCENTILES).tolist() if ttft.size else [],
            "itl_ms": np.percentile(itl, CURVE_PERCENTILES).tolist() if itl.size else [],
            "timeline": sorted(timeline)}


def failure_words(error: str) -> str:
    """A request's error as a person reads it: the server's own message out of "HTTP 400: {json}", else as is."""
    status, sep, body = error.partition(": ")
    if sep and status.startswith("HTTP "):
        try:
            return f"the server refused it ({status}): {json.loads(body)['error']['message']}"
        except (ValueError, KeyError, TypeError):  # not an OpenAI-shaped body (or cut at 200 characters)
            return f"the server refused it ({status}): {body}"
    return error


def exception_words(exc: Exception, base_url: str) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"cannot reach {base_url}: is the engine running?"
    if isinstance(exc, httpx.TimeoutException):
        return f"{base_url} did not answer in time"
    return str(exc) or type(exc).__name__


class BenchmarkWorker(QObject):
    preparing = Signal(int, int)  # prompts built so far, of how many
    outcome = Signal(object)  # RequestOutcome
    finished = Signal(object)  # BenchmarkResult
    failed = Signal(str)
    done = Signal()  # after finished or failed: the thread may quit

    def __init__(self, load: ServeLoad, requests: Requests) -> None:
        super().__init__()
        self.load, self.requests = load, requests
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        try:
            requests = self.requests if isinstance(self.requests, list) else self.requests(self.preparing.emit)
            if self._stop.is_set():
                raise RuntimeError("stopped before any request was sent")
            outcomes, duration = asyncio.run(run_load(self.load, requests, self.outcome.emit, self._stop.is_set))
            if not outcomes:
                raise RuntimeError("stopped before any request was sent")
            self.finished.emit(BenchmarkResult(summarize(outcomes, duration), latency_curves(outcomes),
                                               self._stop.is_set()))
        except Exception as exc:  # any failure becomes a message in the tab, never a dead thread
            self.failed.emit(exception_words(exc, self.load.root))
        finally:
            self.done.emit()


class BenchmarkRunner(QObject):
    """Owns the worker thread of the run in progress (at most one); re-exposes its signals."""

    preparing = Signal(int, int)
    outcome = Signal(object)
    finished = Signal(object)
    failed = Signal(str)
    idle = Signal()  # the worker thread has ended: a new run may start

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._thread: QThread | None = None
        self._worker: BenchmarkWorker | None = None

    def is_running(self) -> bool:
        return self._thread is not None

    def start(self, load: ServeLoad, requests: Requests) -> None:
        assert not self.is_running(), "one benchmark at a time"
        self._worker = BenchmarkWorker(load, requests)
        self._thread = QThread()
        self._worker.moveToThread(self._thread)
        self._thread.started.connect(self._worker.run)
        self._worker.preparing.connect(self.preparing)
        self._worker.outcome.connect(self.outcome)
        self._worker.finished.connect(self.finished)
        self._worker.failed.connect(self.failed)
        self._worker.done.connect(self._thread.quit, Qt.ConnectionType.DirectConnection)
        self._thread.finished.connect(self._forget)
        self._thread.start()

    def stop(self) -> None:
        if self._worker is not None:
            self._worker.stop()

    def wait(self, timeout_ms: int = 10000) -> None:
        """For application exit: stop sending and wait for requests in flight to end."""
        thread = self._thread
        self.stop()
        if thread is not None:
            thread.wait(timeout_ms)

    def _forget(self) -> None:
        self._thread = self._worker = None
        self.idle.emit()
