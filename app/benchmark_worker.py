"""Runs one serving benchmark (engine.bench.serve_load) in its own QThread and reports through signals.

`BenchmarkWorker.run` drives the load with asyncio inside the thread; every finished request is emitted
as `outcome` (the GUI draws live plots from those), and the end as `finished(BenchmarkResult)` or
`failed(message)`. `stop()` ends the schedule early: requests not yet sent are skipped, those in
flight finish. The GUI thread never waits on the network.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import numpy as np
from PySide6.QtCore import QObject, Qt, QThread, Signal

from engine.bench.serve_client import RequestOutcome
from engine.bench.serve_dataset import ServeRequest
from engine.bench.serve_load import ServeLoad, run_load
from engine.bench.serve_metrics import ServeSummary, summarize

CURVE_PERCENTILES = np.arange(1, 100)


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


class BenchmarkWorker(QObject):
    outcome = Signal(object)  # RequestOutcome
    finished = Signal(object)  # BenchmarkResult
    failed = Signal(str)
    done = Signal()  # after finished or failed: the thread may quit

    def __init__(self, load: ServeLoad, requests: list[ServeRequest]) -> None:
        super().__init__()
        self.load, self.requests = load, requests
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        try:
            outcomes, duration = asyncio.run(run_load(self.load, self.requests, self.outcome.emit, self._stop.is_set))
            if not outcomes:
                raise RuntimeError("stopped before any request was sent")
            self.finished.emit(BenchmarkResult(summarize(outcomes, duration), latency_curves(outcomes),
                                               self._stop.is_set()))
        except Exception as exc:  # any failure becomes a message in the tab, never a dead thread
            self.failed.emit(f"{type(exc).__name__}: {exc}")
        finally:
            self.done.emit()


class BenchmarkRunner(QObject):
    """Owns the worker thread of the run in progress (at most one); re-exposes its signals."""

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

    def start(self, load: ServeLoad, requests: list[ServeRequest]) -> None:
        assert not self.is_running(), "one benchmark at a time"
        self._worker = BenchmarkWorker(load, requests)
        self._thread = QThread()
        self._worker.moveToThread(self._thread)
        self._thread.started.connect(self._worker.run)
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
