"""Reads the engine-state SSE stream (GET /v1/engine/state/stream) off the GUI thread.

`StatsWorker.run` loops in its own QThread: connect with httpx (Bearer key when set), parse each
event into an `EngineState` and emit it; on any connection error emit `connected(False)`, wait a
moment and reconnect, so an engine restart is picked up without help. `StatsClient` owns the thread
and is what the window uses: `start(base_url, api_key)`, `stop()`, and the `state` signal.
"""
from __future__ import annotations

import json
import threading

import httpx
from PySide6.QtCore import QObject, Qt, QThread, Signal

from app.engine_state import parse_state
from app.sse import auth_headers, iter_sse_data

RETRY_S = 0.5


class StatsWorker(QObject):
    state = Signal(object)  # EngineState
    connected = Signal(bool)
    error = Signal(str)
    finished = Signal()

    def __init__(self, base_url: str, api_key: str | None, hz: float = 4.0, model: str | None = None) -> None:
        super().__init__()
        self.url = f"{base_url.rstrip('/')}/v1/engine/state/stream"
        self.params = {"hz": hz, **({"model": model} if model else {})}  # the router relays to that model's engine
        self.headers = auth_headers(api_key)
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        timeout = httpx.Timeout(5.0, read=3.0)
        with httpx.Client(timeout=timeout, headers=self.headers) as client:
            while not self._stop.is_set():
                try:
                    self._read_stream(client)
                except (httpx.HTTPError, ValueError, json.JSONDecodeError) as e:
                    self.error.emit(f"{type(e).__name__}: {e}")
                self.connected.emit(False)
                self._stop.wait(RETRY_S)
        self.finished.emit()

    def _read_stream(self, client: httpx.Client) -> None:
        with client.stream("GET", self.url, params=self.params) as response:
            if response.status_code != 200:
                response.read()
                raise ValueError(f"engine state stream answered HTTP {response.status_code}: {response.text[:200]}")
            self.connected.emit(True)
            for payload in iter_sse_data(response):
                if self._stop.is_set():
                    return
                self.state.emit(parse_state(json.loads(payload)))


class StatsClient(QObject):
    """Owns one StatsWorker thread at a time; re-exposes its signals."""

    state = Signal(object)
    connected = Signal(bool)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._thread: QThread | None = None
        self._worker: StatsWorker | None = None
        self._retiring: list[tuple[QThread, StatsWorker]] = []

    def start(self, base_url: str, api_key: str | None = None, hz: float = 4.0, model: str | None = None) -> None:
        self.stop()
        self.model = model
        self._worker = StatsWorker(base_url, api_key, hz, model)
        self._thread = QThread()
        self._worker.moveToThread(self._thread)
        self._thread.started.connect(self._worker.run)
        self._worker.finished.connect(self._thread.quit, Qt.ConnectionType.DirectConnection)
        self._worker.state.connect(self.state)
        self._worker.connected.connect(self.connected)
        self._thread.start()

    def stop(self) -> None:
        """Ask the worker to stop without waiting: it ends within one read timeout (data comes at `hz`)."""
        if self._worker is not None and self._thread is not None:
            self._worker.stop()
            self._worker.state.disconnect(self.state)
            pair = (self._thread, self._worker)
            self._retiring.append(pair)
            self._thread.finished.connect(lambda: self._retiring.remove(pair) if pair in self._retiring else None)
        self._thread = self._worker = None

    def wait_stopped(self, timeout_ms: int = 5000) -> None:
        """For application exit only: wait for retiring worker threads to end."""
        self.stop()
        for thread, _worker in list(self._retiring):
            thread.wait(timeout_ms)
        self._retiring.clear()

    def is_idle(self) -> bool:
        """No worker running or winding down: every stream this client opened is closed."""
        return self._thread is None and not self._retiring

    def is_running(self) -> bool:
        return self._thread is not None
