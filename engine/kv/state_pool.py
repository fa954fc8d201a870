"""StatePool: the slots of a hybrid model's per-sequence linear-attention state (conv + recurrent state).

A Gated DeltaNet layer keeps a fixed-size state per sequence instead of K/V per token, so these slots live
outside the block pool: slot s is index s of every linear-attention layer's conv-state and recurrent-state
tensors (the model runner holds them), and a running sequence holds exactly one slot from admission until it
finishes or is preempted (its state is then dropped and recomputed). A fork takes a fresh slot and a pending
copy of its parent's slot (the model runner applies it before the next forward; blocks stay shared
copy-on-write) — or, when the parent ends in the same step, the last child takes the parent's slot over
without a copy. Slots are handed out lowest first, so a run is reproducible.
"""
from __future__ import annotations

import heapq


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap: the lowest free slot first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"the state pool's {self.num_slots} slots are all held (one per running "
                               "sequence; max_num_seqs bounds them)")
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} is freed but not held")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)

    def held(self) -> set[int]:
        return set(self._used)
