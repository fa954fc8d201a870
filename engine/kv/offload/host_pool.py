"""HostPool: the slots of the CPU-RAM tier, keyed like the device pool's cached blocks, least recently used first.

A slot holds one block id's pages (or, in the state pool of a hybrid model, one state snapshot) under the key the
device pool caches it by (engine/kv/block_pool.group_key). Finding, storing and loading a key moves it to the most
recently used end; making room evicts from the other end, skipping slots a load is still reading (pinned until
that load's copy has run). Plain bookkeeping: the bytes live in the worker's host tensors, slot for slot.
"""
from __future__ import annotations

from collections import OrderedDict


class HostPool:
    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 0
        self.num_slots = num_slots
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest slot first
        self.pins: dict[int, int] = {}  # slot -> loads still reading it

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self.slots

    def lookup(self, key: bytes) -> int | None:
        return self.slots.get(key)

    def touch(self, key: bytes) -> None:
        self.slots.move_to_end(key)

    def allocate(self, key: bytes) -> int | None:
        """A slot for `key` (new to the pool), evicting the least recently used unpinned key if none is free;
        None when every slot is pinned."""
        assert key not in self.slots
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((k for k, s in self.slots.items() if s not in self.pins), None)
            if victim is None:
                return None
            slot = self.slots.pop(victim)
        self.slots[key] = slot
        return slot

    def pin(self, slot: int) -> None:
        self.pins[slot] = self.pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self.pins[slot] - 1
        if left:
            self.pins[slot] = left
        else:
            del self.pins[slot]
