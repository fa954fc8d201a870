"""ReuseGate: whether a block leaving the device pool is worth a copy to the CPU-RAM tier.

It counts, per block key, how many times the block was released by a sequence (each release is one sequence
that used it); a block is stored once it reaches `min_uses`. `min_uses` 1 stores everything; 2 is a
second-chance admission (SGLang HiCache's selective write-through, a doorkeeper): a block one request used once
is not copied until a second request uses it, so one-off prompts do not push shared contexts out of the tier, at
the cost of one recomputation of each context's newest part. The counts survive the block's eviction from the
device (that is the point) and are bounded: the least recently counted keys are forgotten past `capacity`.
`pagedesk-bench offload` measures both on a multi-turn workload (BENCHMARKS.md); the engine stores everything.
"""
from __future__ import annotations

from collections import OrderedDict

STORE_EVERYTHING = 1


class ReuseGate:
    def __init__(self, min_uses: int = STORE_EVERYTHING, capacity: int = 1 << 16) -> None:
        assert min_uses >= 1 and capacity >= 1
        self.min_uses, self.capacity = min_uses, capacity
        self.uses: OrderedDict[bytes, int] = OrderedDict()

    def admit(self, key: bytes) -> bool:
        """Count one release of `key`; True when it has now been used often enough to store."""
        if self.min_uses == STORE_EVERYTHING:
            return True
        uses = self.uses.pop(key, 0) + 1
        self.uses[key] = uses
        if len(self.uses) > self.capacity:
            self.uses.popitem(last=False)
        return uses >= self.min_uses
