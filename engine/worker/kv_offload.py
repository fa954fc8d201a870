"""HostKVTier: this rank's CPU-RAM tier of the prefix cache — host copies of KV pages and state snapshots, and the
queue that copies them to and from the device pool beside the forward.

The host tensors mirror the device pool's, with the slot first so each host slot is one contiguous page:
`[num_host_blocks, num_slots, 2, block_size, kv_heads, head_dim]` (and the integer KV cache's scales likewise), and
per linear-attention layer `[num_host_states, ...]` conv and recurrent states. Pinned on CUDA, so a copy is a DMA.

A step's `KVTransfers` (engine/kv/offload/transfers.py) go to the copy queue as one batch: stores (device -> host)
then loads (host -> device), batches in order. On CUDA the queue is a side stream whose batch first waits for the
compute stream's work queued so far (a store reads what the previous forward wrote); on CPU it is one thread (torch
copies release the GIL, so it runs beside the forward). `fence` makes the coming forward wait for a batch: on CUDA
the compute stream waits on that batch's event (the host never blocks), on CPU the thread is waited for. The
engine's scheduler only asks which batch is done (`completed`), never blocks on a copy unless nothing else can run.
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import OrderedDict
from typing import Callable

import torch

from engine.kv.offload.transfers import KVTransfers
from engine.platform.host_copies import to_device

STAGING_BYTES = 256 << 20  # device scratch per copy chunk on CUDA: gathered pages on their way to or from the host
WAIT_POLL_S = 0.0005


class ThreadCopyQueue:
    """CPU: one daemon thread runs the batches in order; `completed` is the last batch it finished."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done = 0
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, args=(self.jobs, self), name="pagedesk-kv-offload",
                                       daemon=True)
        self.thread.start()

    @staticmethod
    def _run(jobs: queue.SimpleQueue, owner: "ThreadCopyQueue") -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            batch, copy = job
            try:
                copy()
            except BaseException as exc:  # noqa: BLE001 - reported to the engine thread by `completed`
                owner.error = exc
            with owner.cond:
                owner.done = batch
                owner.cond.notify_all()

    def submit(self, batch: int, copy: Callable[[], None]) -> None:
        self.jobs.put((batch, copy))

    def completed(self) -> int:
        self._raise()
        return self.done

    def wait(self, batch: int, timeout: float | None = None) -> bool:
        with self.cond:
            done = self.cond.wait_for(lambda: self.done >= batch or self.error is not None, timeout)
        self._raise()
        return done

    def fence(self, batch: int) -> None:
        self.wait(batch)

    def close(self) -> None:
        """End the thread once the batches queued so far have run (bounded: a held copy must not hang an exit)."""
        self.jobs.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a KV copy to or from the CPU-RAM tier failed: {self.error!r}") from self.error


class StreamCopyQueue:
    """CUDA: the batches run on a side stream, each ending in an event; completion is read off the events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.events: OrderedDict[int, torch.cuda.Event] = OrderedDict()
        self.done = 0

    def submit(self, batch: int, copy: Callable[[], None]) -> None:
        written = torch.cuda.Event()
        written.record()  # on the compute stream: the stores read what its work queued so far writes
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(written)
            copy()
            finished = torch.cuda.Event()
            finished.record(self.stream)
        self.events[batch] = finished

    def completed(self) -> int:
        while self.events:
            batch, event = next(iter(self.events.items()))
            if not event.query():
                break
            self.events.popitem(last=False)
            self.done = batch
        return self.done

    def wait(self, batch: int, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.completed() < batch:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(WAIT_POLL_S)
        return True

    def fence(self, batch: int) -> None:
        """The compute stream waits for the batch on the device; the host goes on."""
        event = self.events.get(batch)
        if event is None:
            assert batch <= self.completed() or not self.events, f"fence on batch {batch}, never submitted"
            return
        torch.cuda.current_stream(self.device).wait_event(event)

    def close(self) -> None:
        self.stream.synchronize()


class HostKVTier:
    def __init__(self, pools, num_blocks: int, num_state_slots: int, device: torch.device) -> None:
        """`pools`: this rank's KVPools (its KV cache allocated): the host copies mirror its tensors."""
        self.pools, self.device = pools, device
        pin = device.type == "cuda"
        # (device tensor with the block index at dim 2, host tensor with the slot first): the pages and any scales.
        # Uninitialised: a slot is only read after a store wrote it (and zeroing tens of GiB takes seconds). Only the
        # host side is kept: the device tensors are the pools' at copy time (sleep mode allocates them anew).
        self.host_pages = [torch.empty((num_blocks, *t.shape[:2], *t.shape[3:]), dtype=t.dtype, pin_memory=pin)
                           for t in pools.block_tensors()]
        self.host_states = [torch.empty((num_state_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                            for pair in pools.state_cache for t in pair] if num_state_slots else []
        self.block_bytes = sum(host[0].numel() * host.element_size() for host in self.host_pages)
        self.last_batch = 0  # the last batch submitted
        self.queue = StreamCopyQueue(device) if device.type == "cuda" else ThreadCopyQueue()
        weakref.finalize(self, self.queue.close)

    def host_bytes(self) -> int:
        return sum(host.numel() * host.element_size() for host in self.host_pages + self.host_states)

    @property
    def pages(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device tensor with the block index at dim 2, host tensor with the slot first): the pages, any scales."""
        return list(zip(self.pools.block_tensors(), self.host_pages))

    @property
    def states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device, host) state tensors of every linear-attention layer: conv, then recurrent, layer by layer."""
        return list(zip([t for pair in self.pools.state_cache for t in pair], self.host_states))

    def submit(self, transfers: KVTransfers) -> None:
        """Queue the batch's copies, then make the coming forward wait for its fence."""
        if transfers.has_copies:
            self.queue.submit(transfers.batch, lambda: self.copy(transfers))
            self.last_batch = transfers.batch
        if transfers.fence:
            self.queue.fence(transfers.fence)

    def completed(self) -> int:
        return self.queue.completed()

    def wait(self, batch: int, timeout: float | None = None) -> bool:
        return self.queue.wait(batch, timeout)

    def drain(self) -> None:
        """Wait for every batch submitted so far (sleep mode: nothing may read or write the pool after)."""
        self.queue.wait(self.last_batch)

    def copy(self, transfers: KVTransfers) -> None:
        """One batch, on the copy queue: stores before loads (a load may read a slot this batch stores)."""
        if transfers.stores:
            self._store_blocks(*zip(*transfers.stores))
        states = self.states if transfers.state_stores or transfers.state_loads else []
        for src, dst in transfers.state_stores:
            for device_state, host_state in states:
                host_state[dst].copy_(device_state[src], non_blocking=True)
        if transfers.loads:
            self._load_blocks(*zip(*transfers.loads))
        for src, dst in transfers.state_loads:
            for device_state, host_state in states:
                device_state[dst].copy_(host_state[src], non_blocking=True)

    def _store_blocks(self, blocks: tuple[int, ...], slots: tuple[int, ...]) -> None:
        pages = self.pages
        for lo, hi in self._chunks(len(blocks)):
            index = to_device(torch.tensor(blocks[lo:hi]), self.device)
            for device_pages, host_pages in pages:
                gathered = device_pages.index_select(2, index).movedim(2, 0)  # [n, num_slots, 2, ...]
                if self.device.type == "cpu":
                    host_pages.index_copy_(0, torch.tensor(slots[lo:hi]), gathered)
                    continue
                gathered = gathered.contiguous()
                for start, end, slot in _runs(slots[lo:hi]):
                    host_pages[slot:slot + end - start].copy_(gathered[start:end], non_blocking=True)

    def _load_blocks(self, slots: tuple[int, ...], blocks: tuple[int, ...]) -> None:
        pages = self.pages
        for lo, hi in self._chunks(len(blocks)):
            index = to_device(torch.tensor(blocks[lo:hi]), self.device)
            for device_pages, host_pages in pages:
                if self.device.type == "cpu":
                    staged = host_pages.index_select(0, torch.tensor(slots[lo:hi]))
                else:
                    staged = torch.empty((hi - lo, *host_pages.shape[1:]), dtype=host_pages.dtype, device=self.device)
                    for start, end, slot in _runs(slots[lo:hi]):
                        staged[start:end].copy_(host_pages[slot:slot + end - start], non_blocking=True)
                device_pages.index_copy_(2, index, staged.movedim(0, 2))

    def _chunks(self, n: int):
        """[lo, hi) pieces whose gathered pages fit the device scratch (the whole batch on CPU)."""
        step = n if self.device.type == "cpu" else max(1, STAGING_BYTES // max(1, self.block_bytes))
        return ((lo, min(n, lo + step)) for lo in range(0, n, step))

    def close(self) -> None:
        self.queue.close()


def _runs(slots: tuple[int, ...]):
    """(start, end, first slot) of each run of consecutive host slots: one contiguous copy each."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, i, slots[start]
            start = i
