"""OffloadConnector: the CPU-RAM tier as the block pool, the KV cache manager and the scheduler see it.

Stores: a full, hashed block whose last reference drops (it joins the device pool's free queue, still findable) is
copied to a host slot under the same key, if the reuse gate admits it and the tier does not hold the key yet; a
hybrid model's state snapshot pushed out of its device slot is copied to a host state slot. Copies are only queued
here: they leave with the next step (`take`) and run on the worker's copy queue beside the forward, so a store is
off the step's critical path unless the step overwrites the block it reads (the pool evicts it: `block_reused`),
then that step's forward waits for it (the fence).

Loads: a prefix lookup that misses the device pool continues in the tier (`find`); each hit block gets a fresh device
block and a queued copy, its host slot pinned until the copy has run, and the sequence waits (the scheduler's
`loading` list) until `complete` reports its batch done. Its blocks become findable in the device pool only then.

Batches are numbered in the order they are taken; the worker runs them in that order on one queue, so a load
always sees the stores queued before it. Counters (`stats`) feed /metrics and the engine-state stream.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.kv.offload.host_pool import HostPool
from engine.kv.offload.reuse_gate import ReuseGate
from engine.kv.offload.transfers import KVTransfers


class HostBlock:
    """A prefix hit's entry that lives in the tier, not the device pool: the allocation gives it a device block."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def __repr__(self) -> str:
        return f"HostBlock(slot={self.slot})"


@dataclass
class TierStats:
    """The tier since start (tokens are prompt tokens; bytes are one rank's shard)."""

    num_blocks: int = 0  # host slots for blocks
    num_state_slots: int = 0  # host slots for a hybrid model's state snapshots
    bytes_per_block: int = 0
    state_slot_bytes: int = 0
    blocks_held: int = 0
    states_held: int = 0
    hit_tokens: int = 0  # prompt tokens the device cache missed and the tier restored
    miss_tokens: int = 0  # prompt tokens the device cache missed and the tier did not hold either
    blocks_stored: int = 0
    blocks_loaded: int = 0
    states_stored: int = 0
    states_loaded: int = 0
    stores_skipped: int = 0  # admitted blocks that found every host slot pinned by loads
    loads_in_flight: int = 0

    @property
    def bytes_stored(self) -> int:
        return self.blocks_stored * self.bytes_per_block + self.states_stored * self.state_slot_bytes

    @property
    def bytes_loaded(self) -> int:
        return self.blocks_loaded * self.bytes_per_block + self.states_loaded * self.state_slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_state_slots * self.state_slot_bytes

    def as_dict(self) -> dict:
        return {"num_blocks": self.num_blocks, "blocks_held": self.blocks_held, "num_state_slots": self.num_state_slots,
                "states_held": self.states_held, "capacity_bytes": self.capacity_bytes,
                "hit_tokens": self.hit_tokens, "miss_tokens": self.miss_tokens, "bytes_stored": self.bytes_stored,
                "bytes_loaded": self.bytes_loaded, "blocks_stored": self.blocks_stored,
                "blocks_loaded": self.blocks_loaded, "loads_in_flight": self.loads_in_flight}


class OffloadConnector:
    def __init__(self, num_blocks: int, bytes_per_block: int, num_state_slots: int = 0, state_slot_bytes: int = 0,
                 gate: ReuseGate | None = None) -> None:
        self.blocks = HostPool(num_blocks)
        self.states = HostPool(num_state_slots)
        self.gate = gate or ReuseGate()
        self.stats = TierStats(num_blocks, num_state_slots, bytes_per_block, state_slot_bytes)
        self.next_batch = 1  # the batch being filled; `take` hands it out
        self.completed = 0  # every batch up to this one has run on rank 0
        self.pending = KVTransfers()
        self.fence = 0
        # Device block id -> the batch of its latest store. Never pruned by rank 0's progress: a worker's copy
        # queue may be behind rank 0's, and a fence on a batch that already ran costs nothing.
        self.storing: dict[int, int] = {}
        self.pinned: dict[int, tuple[list[int], list[int]]] = {}  # batch -> (host block slots, host state slots)

    # ---- the device pool's events ------------------------------------------------------------------------

    def block_freed(self, block) -> None:
        """A cached block's last reference dropped: store it unless the tier has it or the gate says no."""
        key = block.block_hash
        if key in self.blocks:
            self.blocks.touch(key)
            return
        if not self.gate.admit(key):
            return
        slot = self.blocks.allocate(key)
        if slot is None:
            self.stats.stores_skipped += 1
            return
        self.pending.stores.append((block.block_id, slot))
        self.storing[block.block_id] = self.next_batch
        self.stats.blocks_stored += 1

    def block_reused(self, block) -> None:
        """The device pool hands `block` out again: the forward that writes it waits for a store that read it."""
        batch = self.storing.pop(block.block_id, 0)
        if batch:
            self.fence = max(self.fence, batch)

    def store_state(self, key: bytes, state_slot: int) -> None:
        """A state snapshot leaves its device slot (which this step's state copies overwrite: fenced)."""
        if key in self.states:
            self.states.touch(key)
            return
        slot = self.states.allocate(key)
        if slot is None:
            self.stats.stores_skipped += 1
            return
        self.pending.state_stores.append((state_slot, slot))
        self.fence = max(self.fence, self.next_batch)  # the snapshot slot is a snapshot again before the forward
        self.stats.states_stored += 1

    # ---- prefix hits ---------------------------------------------------------------------------------------

    def find(self, key: bytes) -> HostBlock | None:
        slot = self.blocks.lookup(key)
        return None if slot is None else HostBlock(slot)

    def find_state(self, key: bytes) -> int | None:
        return self.states.lookup(key)

    def load(self, key: bytes, slot: int, block_id: int) -> int:
        """Queue host slot -> device block; the slot stays pinned until the copy ran. Returns the load's batch."""
        self.blocks.touch(key)
        self.blocks.pin(slot)
        self.pending.loads.append((slot, block_id))
        self.stats.blocks_loaded += 1
        return self.next_batch

    def load_state(self, key: bytes, slot: int, state_slot: int) -> int:
        self.states.touch(key)
        self.states.pin(slot)
        self.pending.state_loads.append((slot, state_slot))
        self.stats.states_loaded += 1
        return self.next_batch

    def count_lookup(self, device_miss_tokens: int, hit_tokens: int) -> None:
        """A fresh admission: of the prompt tokens the device cache missed, how many the tier restores."""
        self.stats.hit_tokens += hit_tokens
        self.stats.miss_tokens += max(0, device_miss_tokens - hit_tokens)

    # ---- one step ------------------------------------------------------------------------------------------

    def require(self, batch: int) -> None:
        """The coming forward reads what batch `batch` copied (a sequence whose load finished runs now)."""
        self.fence = max(self.fence, batch)

    def take(self, forward: bool = True) -> KVTransfers | None:
        """This step's copies (a batch with its number) and, for a step that runs a forward, its fence; None when
        there is neither. A step without a forward leaves the fence to the next one that writes."""
        transfers, self.pending = self.pending, KVTransfers()
        if transfers.has_copies:
            transfers.batch = self.next_batch
            self.pinned[transfers.batch] = ([s for s, _ in transfers.loads], [s for s, _ in transfers.state_loads])
            self.next_batch += 1
        if forward:
            transfers.fence, self.fence = self.fence, 0
        return transfers if transfers.has_copies or transfers.fence else None

    def complete(self, done: int) -> None:
        """Rank 0's copy queue has run every batch up to `done`: unpin their host slots, forget their stores."""
        if done <= self.completed:
            return
        for batch in range(self.completed + 1, done + 1):
            blocks, states = self.pinned.pop(batch, ((), ()))
            for slot in blocks:
                self.blocks.unpin(slot)
            for slot in states:
                self.states.unpin(slot)
        self.completed = done

    @property
    def in_flight(self) -> bool:
        """Batches handed out that rank 0 has not seen finish."""
        return self.next_batch - 1 > self.completed

    def snapshot_stats(self) -> TierStats:
        s = self.stats
        s.blocks_held, s.states_held = len(self.blocks), len(self.states)
        return TierStats(**{f: getattr(s, f) for f in s.__dataclass_fields__})
