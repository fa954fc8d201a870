"""StepWatchdog: notices an engine step that never returns, or a tensor-parallel worker that stopped beating.

The engine thread brackets each `step()` with `step_started()` / `step_ended()`. A thread of the watchdog's
own polls: when the step in progress has run longer than `--step-timeout` (the first step, which compiles
kernels, gets at least FIRST_STEP_TIMEOUT_S), or when the executor's thread-safe liveness check names a
problem (a worker SIGSTOPped or on a hung card: its heartbeat is separate from step progress, so this is
seen within LIVENESS_POLL_S on any device, not after the step timeout), it calls `on_stuck` once with a
message and stops. What to do then (fail the streams, end the workers) is the AsyncEngine's business;
this module only watches the clock and the heartbeat.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

FIRST_STEP_TIMEOUT_S = 300.0  # the first step compiles kernels: the watchdog allows it at least this long
DEFAULT_STEP_TIMEOUT_S = {"cuda": 30.0, "cpu": 600.0}  # --step-timeout unset: a CPU prefill step can be slow
LIVENESS_POLL_S = 0.5


def resolve_step_timeout(configured: float | None, device: Any) -> float:
    if configured is not None:
        return float(configured)
    return DEFAULT_STEP_TIMEOUT_S["cuda" if getattr(device, "type", None) == "cuda" else "cpu"]


class StepWatchdog:
    def __init__(self, step_timeout: float = 0.0) -> None:
        self.step_timeout = step_timeout  # 0: steps are not timed (the heartbeat may still be watched)
        self._step_started: float | None = None  # monotonic start of the step in progress
        self._steps_done = 0
        self._stop = threading.Event()

    def step_started(self) -> None:
        self._step_started = time.monotonic()

    def step_ended(self) -> None:
        self._step_started = None
        self._steps_done += 1

    def stuck_seconds(self, now: float) -> float | None:
        """How long the step in progress has run, if that is over its limit (else None)."""
        started = self._step_started
        if started is None or self.step_timeout <= 0:
            return None
        limit = self.step_timeout if self._steps_done else max(self.step_timeout, FIRST_STEP_TIMEOUT_S)
        elapsed = now - started
        return elapsed if elapsed > limit else None

    def stuck_message(self, elapsed: float) -> str:
        return (f"an engine step has run for {elapsed:.0f} s, over the {self.step_timeout:g} s limit "
                "(--step-timeout): a GPU or a tensor-parallel worker is stuck; restart the engine")

    def start(self, liveness: Callable[[], str | None] | None, serving: Callable[[], bool],
              on_stuck: Callable[[str], None]) -> bool:
        """Watch in a daemon thread while `serving()`; False (no thread) when there is nothing to watch."""
        if self.step_timeout <= 0 and liveness is None:
            return False
        threading.Thread(target=self._run, args=(liveness, serving, on_stuck), name="pagedesk-step-watchdog",
                         daemon=True).start()
        return True

    def stop(self) -> None:
        self._stop.set()

    def _run(self, liveness, serving, on_stuck) -> None:
        poll = min(1.0, self.step_timeout / 4) if self.step_timeout > 0 else LIVENESS_POLL_S
        if liveness is not None:
            poll = min(poll, LIVENESS_POLL_S)
        while not self._stop.wait(poll) and serving():
            problem = liveness() if liveness is not None else None
            if problem is not None:
                on_stuck(problem)
                return
            elapsed = self.stuck_seconds(time.monotonic())
            if elapsed is not None:
                on_stuck(self.stuck_message(elapsed))
                return
