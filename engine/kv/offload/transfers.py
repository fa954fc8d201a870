"""KVTransfers: one step's copies between the device pool and the CPU-RAM tier, as plain picklable data.

Rank 0's scheduler fills it (engine/kv/offload/connector.py); every rank runs it on its own shard, in `batch` order
on one copy queue (engine/worker/kv_offload.py): stores first (device block -> host slot, a hybrid model's state
snapshot -> host state slot), then loads (the reverse). `fence` names the latest batch the coming forward depends
on: a block (or state slot) it overwrites that a store still reads, or a block a load wrote for a sequence that
runs now. Each rank waits for its own copies up to `fence` before the forward, so a prefix hit from the tier is a
hit on every rank or on none, and no rank reads a block before its copy has landed.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KVTransfers:
    batch: int = 0  # this batch's number (1, 2, ...), 0 when it carries no copies (only a fence)
    stores: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block id)
    state_stores: list[tuple[int, int]] = field(default_factory=list)  # (device state slot, host state slot)
    state_loads: list[tuple[int, int]] = field(default_factory=list)  # (host state slot, device state slot)
    fence: int = 0  # wait for every batch up to this one before the forward (0: none)

    @property
    def has_copies(self) -> bool:
        return bool(self.stores or self.loads or self.state_stores or self.state_loads)
