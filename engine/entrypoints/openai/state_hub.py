"""SnapshotHub: at most one engine-state snapshot per tick, shared by every reader, under a global rate cap.

Taking a snapshot costs the engine thread a copy of the block pool between two steps, so it must not
scale with the number of GUI windows or scripts watching: readers ask the hub for a snapshot newer than
the one they hold; a fresh one (younger than the tick) is handed out as is, otherwise one collection
starts and every reader waiting meanwhile shares it. A one-off reader that needs the state as of its
call (`started_after`) gets a snapshot begun after it asked. Collections are at least `min_interval`
apart whatever the readers ask for, and streaming subscribers together get at most MAX_EVENTS_PER_S
events a second (each slows down as more join), since writing events also costs the engine's process
time. The JSON is encoded once per snapshot, not once per reader.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

MAX_SNAPSHOTS_PER_S = 20.0  # the fastest a client may ask for (hz ≤ 20), and the most the engine pays for
MAX_EVENTS_PER_S = 100.0  # events a second over all stream subscribers together


@dataclass(frozen=True, slots=True)
class Snapshot:
    seq: int  # 1, 2, ... in the order they were taken
    body: str  # the encoded JSON document
    started_at: float  # hub clock when its collection began


class SnapshotHub:
    def __init__(self, produce: Callable[[], Awaitable[str]], min_interval: float = 1.0 / MAX_SNAPSHOTS_PER_S,
                 clock: Callable[[], float] = time.monotonic):
        self._produce, self.min_interval, self._clock = produce, min_interval, clock
        self._latest: Snapshot | None = None
        self._taken_at = -math.inf
        self._inflight: asyncio.Future | None = None
        self.num_collected = 0
        self.subscribers = 0  # open streams, counted by the stream route

    def interval(self, hz: float) -> float:
        """Seconds between one subscriber's events: what it asked for, or its share of the global budget."""
        return max(1.0 / hz, self.subscribers / MAX_EVENTS_PER_S)

    async def get(self, newer_than: int = 0, started_after: float | None = None) -> Snapshot:
        """A snapshot newer than seq `newer_than` (and fresh), or begun after `started_after` on the hub's clock;
        raises what its collection raised."""
        latest = self._latest
        if latest is not None and latest.seq > newer_than and started_after is None \
                and self._clock() - self._taken_at < self.min_interval:
            return latest
        while True:
            if self._inflight is None:
                self._inflight = asyncio.ensure_future(self._collect())
                self._inflight.add_done_callback(_retrieve)
            snap = await asyncio.shield(self._inflight)  # one reader leaving does not cancel the others' snapshot
            if started_after is None or snap.started_at >= started_after:
                return snap

    def now(self) -> float:
        return self._clock()

    async def _collect(self) -> Snapshot:
        try:
            wait = self._taken_at + self.min_interval - self._clock()
            if wait > 0:
                await asyncio.sleep(wait)
            started = self._clock()
            body = await self._produce()
            self.num_collected += 1
            self._taken_at = self._clock()
            self._latest = Snapshot((self._latest.seq if self._latest else 0) + 1, body, started)
            return self._latest
        finally:
            self._inflight = None


def _retrieve(future: asyncio.Future) -> None:
    """Mark a failed collection's error as seen when no reader was left to await it."""
    if not future.cancelled():
        future.exception()
