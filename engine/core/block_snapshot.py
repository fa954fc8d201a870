"""A picture of every physical KV block (state, ref count, owner, KV cache group, whether it holds image tokens) for
the GUI's block map, and of a hybrid model's state slots beside it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kv.block_pool import NULL_BLOCK, BlockPool
from engine.core.outputs import BlockPoolSnapshot, RequestState
from engine.core.sequence import Sequence

FREE, USED, CACHED_FREE = 0, 1, 2
SLOT_FREE, SLOT_SEQUENCE, SLOT_SNAPSHOT = 0, 1, 2
MAX_WAITING_LISTED = 256


def snapshot_blocks(pool: BlockPool, running: list[Sequence], waiting: list[Sequence],
                    group_names: list[str] | None = None, state_slots: StateSlots | None = None,
                    block_size: int = 0) -> BlockPoolSnapshot:
    """`group_names`: one per KV cache group when there are several (then each block's group is recorded);
    `state_slots`: a hybrid model's state pool, pictured slot by slot beside the blocks; `block_size`: tokens per
    block, which places a running request's image placeholders in its blocks (0: image blocks not marked)."""
    n = pool.num_blocks  # entry i pictures pool.blocks[i], block i + 1 (block 0 is the reserved null block)
    ref_count = np.fromiter((b.ref_count for b in pool.blocks), dtype=np.int32, count=n)
    state = np.where(ref_count > 0, USED, FREE).astype(np.uint8)
    for block_hash, block in pool.cached.items():
        if block.ref_count == 0:
            state[block.block_id - 1] = CACHED_FREE
    owner = np.full(n, -1, dtype=np.int32)
    owner_ids: list[str] = []
    group = np.full(n, -1, dtype=np.int8) if group_names and len(group_names) > 1 else None
    index: dict[str, int] = {}
    for seq in running:
        rid = seq.request.request_id
        k = index.setdefault(rid, len(owner_ids))
        if k == len(owner_ids):
            owner_ids.append(rid)
        for g, table in enumerate(seq.block_tables):
            ids = np.fromiter((b.block_id - 1 for b in table if b is not NULL_BLOCK), dtype=np.int64)
            unowned = ids[owner[ids] < 0]
            owner[unowned] = k
            if group is not None:
                group[ids] = g
    requests = {}
    for status, seqs in (("running", running), ("waiting", waiting[:MAX_WAITING_LISTED])):
        for seq in seqs:
            rid = seq.request.request_id
            row = requests.setdefault(rid, RequestState(rid, status, 0, seq.num_prompt_tokens, 0, 0))
            row.num_blocks += sum(1 for table in seq.block_tables for b in table if b is not NULL_BLOCK)
            row.num_computed_tokens += seq.num_computed_tokens
            row.num_generated_tokens += seq.num_output_tokens
    slots = None if state_slots is None else state_slot_picture(state_slots, running, index)
    return BlockPoolSnapshot(state, ref_count, owner, owner_ids, list(requests.values()), group,
                             list(group_names or []) if group is not None else [], slots,
                             image_blocks(running, block_size) if block_size else [])


def image_blocks(running: list[Sequence], block_size: int) -> list[int]:
    """Sorted entries of the picture (block id - 1, as every per-block array here) whose blocks hold an image's
    placeholders (any KV cache group)."""
    ids: set[int] = set()
    for seq in running:
        mm = seq.request.mm
        for item in mm.items if mm is not None else ():
            first, last = item.offset // block_size, (item.end - 1) // block_size
            for table in seq.block_tables:
                ids.update(b.block_id - 1 for b in table[first:last + 1] if b is not NULL_BLOCK)
    return sorted(ids)


@dataclass(frozen=True, slots=True)
class StateSlots:
    """What the picture of a state pool needs: its size, the snapshot slots in use, their cap, one slot's bytes."""

    num_slots: int
    snapshot_slots: tuple[int, ...]
    max_snapshots: int
    slot_bytes: int


def state_slot_picture(state: StateSlots, running: list[Sequence], owner_index: dict[str, int]) -> dict:
    """The engine-state document's "state_slots": per slot, its kind (0 free, 1 a running sequence's, 2 a
    prefix-cache snapshot) and owner (request index + 1, as in the block owner array; 0 for none)."""
    kind = [SLOT_FREE] * state.num_slots
    owner = [0] * state.num_slots
    for seq in running:
        if seq.state_slot is not None:
            kind[seq.state_slot] = SLOT_SEQUENCE
            owner[seq.state_slot] = owner_index[seq.request.request_id] + 1
    for slot in state.snapshot_slots:
        kind[slot] = SLOT_SNAPSHOT
    return {"num_slots": state.num_slots, "kind": kind, "owner": owner, "max_snapshots": state.max_snapshots,
            "slot_bytes": state.slot_bytes}
