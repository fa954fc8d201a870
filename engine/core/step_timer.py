"""StepTimer: where each engine step's wall time goes, phase by phase, on the host's clock.

The engine core laps it between the parts of a step (schedule, plan the sampling rows, the runner's input
preparation, the forward with its sampling, output processing, building outputs); a model runner that was handed
the timer laps "prepare" itself. A lap is one `perf_counter` call and an addition, so the timer is always on.
`host_s` is the step's time outside the forward: what the Python around the model costs, the figure
`pagedesk-bench steps` reports at batch 1, 8 and 64. With async scheduling, "forward" is the launch of the next
step plus the wait for the previous one's results, so the host phases are what the device does not hide.
"""
from __future__ import annotations

import time

PHASES = ("schedule", "plan", "prepare", "forward", "process", "outputs")


class StepTimer:
    __slots__ = ("laps", "totals", "num_steps", "_last")

    def __init__(self) -> None:
        self.laps = dict.fromkeys(PHASES, 0.0)  # the last step's seconds per phase
        self.totals = dict.fromkeys(PHASES, 0.0)  # summed over every step timed
        self.num_steps = 0
        self._last = 0.0

    def start(self) -> None:
        for phase in PHASES:
            self.laps[phase] = 0.0
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """The time since the last lap (or the start) went to `phase`."""
        now = time.perf_counter()
        self.laps[phase] += now - self._last
        self._last = now

    def end(self) -> None:
        for phase, seconds in self.laps.items():
            self.totals[phase] += seconds
        self.num_steps += 1

    @property
    def step_s(self) -> float:
        return sum(self.laps.values())

    @property
    def host_s(self) -> float:
        """The last step's seconds outside the forward."""
        return self.step_s - self.laps["forward"]
