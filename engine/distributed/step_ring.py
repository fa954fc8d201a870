"""StepRing: rank 0's per-step inputs to its tensor-parallel workers through shared memory, with no reply.

A ring of `num_slots` slots in one shared `RawArray` (the heartbeat's mechanism: handed to each worker when
it is spawned, nothing to unlink, nothing left behind if a process is killed). Step N's pickled StepInputs go
to slot N % num_slots: payload first, then its length and CRC-32, then N itself, which publishes it; a worker
that sees its next step number in that slot copies the payload, checks it against the CRC, runs the step and
stores N as its own read mark.

Python has no memory fence, and program order between plain stores to shared memory holds on x86 (TSO) but not
on aarch64 or POWER, where a reader may see N before the payload written ahead of it. So the reader never
trusts the order: a copy whose CRC-32 does not match its header is a slot still being written, and is taken
again on the next poll (a torn payload passing the check is a 2^-32 event per torn read). The read mark needs no
fence either: the worker stores it only after it has checked (and then used) the copied bytes, so the store
depends on those loads, and no CPU makes a store visible before the loads it depends on.
Nobody answers: rank 0 writes step N + 1 while the workers still read or run N, and only waits (briefly,
watching that every worker is alive) for a slot that a worker has not read yet, which the forward's
collectives make all but impossible with more than two slots. A semaphore per worker wakes it (a hint: the
ring and the pipe are what it reads), so an idle worker sleeps instead of polling. A step too large for a
slot, control commands and their answers, errors and shutdown stay on the pipe; every pipe message names
the last step published before it, so a worker runs those first and order is kept.
"""
from __future__ import annotations

import struct
import time
import zlib
from typing import Callable

NUM_SLOTS = 4
SLOT_BYTES = 2 << 20  # a decode step of hundreds of sequences is tens of KiB; a long prefill chunk a few MiB
_SLOT_HEADER = struct.Struct("<QQQ")  # step number, payload length, payload CRC-32
_MARK = struct.Struct("<Q")


class StepRing:
    """The shared buffer and wake semaphores (made by rank 0 before it spawns the workers)."""

    def __init__(self, ctx, num_readers: int, num_slots: int = NUM_SLOTS, slot_bytes: int = SLOT_BYTES) -> None:
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self.buffer = ctx.RawArray("B", _MARK.size * num_readers + num_slots * (_SLOT_HEADER.size + slot_bytes))
        self.wakes = [ctx.Semaphore(0) for _ in range(num_readers)]
        self.seq = 0  # steps published (rank 0)

    def reader(self, index: int) -> "StepReader":
        return StepReader(self.buffer, self.wakes[index], index, self.num_readers, self.num_slots, self.slot_bytes)

    def _view(self) -> memoryview:
        return memoryview(self.buffer).cast("B")

    def _slot(self, seq: int) -> int:
        return _MARK.size * self.num_readers + (seq % self.num_slots) * (_SLOT_HEADER.size + self.slot_bytes)

    def read_marks(self) -> list[int]:
        view = self._view()
        return [_MARK.unpack_from(view, _MARK.size * i)[0] for i in range(self.num_readers)]

    def publish(self, payload: bytes, check_alive: Callable[[], None], poll_s: float = 0.0005) -> int | None:
        """Write the next step; its number, or None when it does not fit a slot (the caller sends it over the
        pipe with that number: the step is counted either way). `check_alive` raises for a dead worker while
        waiting for a slot to be read."""
        self.seq += 1
        seq = self.seq
        if len(payload) > self.slot_bytes:
            return None
        while min(self.read_marks()) < seq - self.num_slots:  # the slot still holds a step someone has not read
            check_alive()
            time.sleep(poll_s)
        view, at = self._view(), self._slot(seq)
        start = at + _SLOT_HEADER.size
        view[start:start + len(payload)] = payload
        _MARK.pack_into(view, at + _MARK.size, len(payload))
        _MARK.pack_into(view, at + 2 * _MARK.size, zlib.crc32(payload))
        _MARK.pack_into(view, at, seq)  # last: the step is published (the slot held step seq - num_slots)
        return seq

    def wake(self) -> None:
        for wake in self.wakes:
            wake.release()


class StepReader:
    """A worker's end: its own read mark, its wake semaphore, the same buffer."""

    def __init__(self, buffer, wake, index: int, num_readers: int, num_slots: int, slot_bytes: int) -> None:
        self.buffer, self.wake, self.index = buffer, wake, index
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self.next_seq = 1

    def take(self) -> bytes | None:
        """The next step's payload if rank 0 published it (not yet marked read) and all of it is visible, else
        None (poll again)."""
        view = memoryview(self.buffer).cast("B")
        at = _MARK.size * self.num_readers + (self.next_seq % self.num_slots) * (_SLOT_HEADER.size + self.slot_bytes)
        seq, length, crc = _SLOT_HEADER.unpack_from(view, at)
        if seq != self.next_seq or length > self.slot_bytes:
            return None
        start = at + _SLOT_HEADER.size
        payload = bytes(view[start:start + length])  # a copy: the slot may be rewritten once marked read
        if zlib.crc32(payload) != crc:  # seen before all of its bytes (a weakly ordered CPU): not yet published
            return None
        return payload

    def done(self) -> None:
        """The step taken (from the ring or the pipe) is read: its slot may be reused."""
        _MARK.pack_into(memoryview(self.buffer).cast("B"), _MARK.size * self.index, self.next_seq)
        self.next_seq += 1
        self.wake.acquire(block=False)  # its wake-up, if not consumed by a sleep: no backlog of stale wakes

    def sleep(self, timeout_s: float) -> None:
        """Until rank 0 wakes this worker (a new step or command) or `timeout_s` passes."""
        self.wake.acquire(timeout=timeout_s)
