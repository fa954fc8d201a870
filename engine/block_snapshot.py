"""A picture of every physical KV block (state, ref count, owner, KV cache group) for the GUI's block map."""
from __future__ import annotations

import numpy as np

from engine.block_pool import NULL_BLOCK, BlockPool
from engine.outputs import BlockPoolSnapshot, RequestState
from engine.sequence import Sequence

FREE, USED, CACHED_FREE = 0, 1, 2
MAX_WAITING_LISTED = 256


def snapshot_blocks(pool: BlockPool, running: list[Sequence], waiting: list[Sequence],
                    group_names: list[str] | None = None) -> BlockPoolSnapshot:
    """`group_names`: one per KV cache group when there are several (then each block's group is recorded)."""
    n = pool.num_blocks
    ref_count = np.fromiter((b.ref_count for b in pool.blocks), dtype=np.int32, count=n)
    state = np.where(ref_count > 0, USED, FREE).astype(np.uint8)
    for block_hash, block in pool.cached.items():
        if block.ref_count == 0:
            state[block.block_id] = CACHED_FREE
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
            ids = np.fromiter((b.block_id for b in table if b is not NULL_BLOCK), dtype=np.int64)
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
    return BlockPoolSnapshot(state, ref_count, owner, owner_ids, list(requests.values()), group,
                             list(group_names or []) if group is not None else [])
