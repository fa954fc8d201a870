"""One small manager per KV cache group kind: a group's block table of each sequence (vLLM v1's
single_type_kv_cache_manager).

Both kinds grow a table positionally (entry i holds tokens [i*bs, (i+1)*bs)), register full blocks in the
prefix cache under the group's key, share blocks between forks by ref count and copy a shared partial block
before writing into it. A sliding-window group also frees the blocks that lie wholly behind the window of
the next token to compute, leaving `NULL_BLOCK` in their entries (nulls always form a prefix of its table),
and its prefix hit is the LATEST run of cached blocks that covers a window (vLLM's rule), not the longest
run from the start: blocks before that run are never read again, so they need not be cached at all.
The state group of a hybrid model (linear-attention layers) has no blocks: `StateManager` gives each sequence
one slot of the state pool (engine/kv/state_pool.py) and copies it for a fork.
The coordinator (engine/kv/kv_cache_manager.py) decides how many tokens a step allocates; these only act on it.
"""
from __future__ import annotations

from typing import Callable

from engine.kv.block_pool import NULL_BLOCK, Block, BlockPool, group_key
from engine.kv.kv_cache_interface import KVSpec, SlidingWindowSpec, StateSpec
from engine.kv.state_pool import StatePool


class FullAttentionManager:
    def __init__(self, pool: BlockPool, spec: KVSpec, group: int) -> None:
        self.pool, self.spec, self.group = pool, spec, group
        self.block_size = spec.block_size

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_blocks: int,
                               lookup: Callable[[bytes], object] | None = None) -> list[Block]:
        """The leading run of cached blocks (any shorter prefix of it is a hit too). `lookup`: where a key is
        found, the device pool by default (with a CPU-RAM tier: the pool, else the tier's HostBlock)."""
        lookup = lookup or self.pool.lookup
        hits: list[Block] = []
        for block_hash in block_hashes[:max_blocks]:
            block = lookup(group_key(block_hash, self.group))
            if block is None:
                break
            hits.append(block)
        return hits

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading entries the next token to compute never reads: none for full attention."""
        return 0

    def num_held_blocks_after(self, num_computed_tokens: int, num_tokens: int) -> int:
        """Physical blocks the table holds once slots reach `num_tokens` with `num_computed_tokens` computed."""
        return -(-num_tokens // self.block_size) - self.num_skipped_blocks(num_computed_tokens)

    def remove_skipped_blocks(self, seq, num_computed_tokens: int) -> None:
        """Full attention reads every earlier block: nothing is ever skipped."""

    def needs_copy(self, seq, num_computed: int) -> bool:
        table, bs = seq.block_tables[self.group], self.block_size
        index = num_computed // bs
        return num_computed % bs != 0 and index < len(table) and table[index].ref_count > 1

    def take_hit(self, seq, hit: list[Block]) -> None:
        """A prefix hit's blocks join the table. Every group takes its hit before any group allocates: a cached
        free block of one group's hit must leave the free queue before another group's allocation evicts it.
        Entries found in the CPU-RAM tier join as they are (the coordinator gives them device blocks next)."""
        self.pool.touch(b for b in hit if b.__class__ is Block)
        seq.block_tables[self.group].extend(hit)

    def allocate(self, seq, num_computed: int, cow: bool, num_new_blocks: int,
                 pending_copies: list[tuple[int, int]]) -> None:
        table = seq.block_tables[self.group]
        if cow:
            index = num_computed // self.block_size
            shared, fresh = table[index], self.pool.get_new_blocks(1)[0]
            pending_copies.append((shared.block_id, fresh.block_id))
            self.pool.free_blocks([shared])
            table[index] = fresh
            seq.mark_table_edit(self.group, index)
        if num_new_blocks > 0:
            table.extend(self.pool.get_new_blocks(num_new_blocks))

    def cache_full_blocks(self, seq, first: int, last: int) -> None:
        """Entries [first, last) will be full after this step: findable by their hash from now on."""
        table, hashes = seq.block_tables[self.group], seq.block_hashes
        for i in range(first, last):
            block = table[i]
            if block.block_hash is None:  # hit blocks and NULL_BLOCK already carry one
                self.pool.cache_block(block, group_key(hashes[i], self.group))

    def free(self, seq, first_uncomputed: int, num_cached_blocks: int) -> None:
        """Blocks hashed at allocation but never written leave the cache; the rest go back tail first."""
        table = seq.block_tables[self.group]
        for block in table[first_uncomputed:num_cached_blocks]:
            assert block.ref_count == 1, f"{block} is shared but was never computed"
            self.pool.uncache_block(block)
        self.pool.free_blocks(reversed(table))
        table.clear()
        seq.mark_table_edit(self.group, 0)


class SlidingWindowManager(FullAttentionManager):
    spec: SlidingWindowSpec

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_blocks: int,
                               lookup: Callable[[bytes], object] | None = None) -> list[Block]:
        """The hit ending latest (at most `max_blocks`) whose last `window_blocks` blocks are all cached; entries
        before them are NULL_BLOCK. A cached run that reaches the very first block counts at any length."""
        need, lookup = self.spec.window_blocks, lookup or self.pool.lookup
        run: list[Block] = []
        for i in range(min(max_blocks, len(block_hashes)) - 1, -1, -1):
            block = lookup(group_key(block_hashes[i], self.group))
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == need:
                return [NULL_BLOCK] * i + run[::-1]
        return run[::-1]  # empty, or a run from block 0 shorter than a window

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """The entries before the block holding the first key the next token can see."""
        return max(0, (num_computed_tokens - self.spec.sliding_window + 1) // self.block_size)

    def remove_skipped_blocks(self, seq, num_computed_tokens: int) -> None:
        """Free the skipped entries (NULL_BLOCK takes their place)."""
        table = seq.block_tables[self.group]
        end = min(self.num_skipped_blocks(num_computed_tokens), len(table))
        i = end - 1
        while i >= 0 and table[i] is not NULL_BLOCK:
            i -= 1
        if i == end - 1:
            return
        freed = table[i + 1:end]
        table[i + 1:end] = [NULL_BLOCK] * len(freed)
        seq.mark_table_edit(self.group, i + 1)
        self.pool.free_blocks(freed)  # oldest first into the queue: the first evicted (a hit wants the latest)


def make_manager(pool: BlockPool, spec: KVSpec, group: int) -> FullAttentionManager:
    return (SlidingWindowManager if isinstance(spec, SlidingWindowSpec) else FullAttentionManager)(pool, spec, group)


class StateManager:
    """One state slot per sequence (`seq.state_slot`), held from its first allocation until it is freed."""

    def __init__(self, pool: StatePool, spec: StateSpec | None = None) -> None:
        self.pool, self.spec = pool, spec

    def needs_slot(self, seq) -> bool:
        return seq.state_slot is None

    def allocate(self, seq) -> None:
        seq.state_slot = self.pool.allocate()

    def free(self, seq) -> None:
        """The state is dropped: a preempted sequence recomputes it from its tokens."""
        if seq.state_slot is not None:
            self.pool.free(seq.state_slot)
            seq.state_slot = None

    def fork(self, parent, child, take_over: bool, pending_copies: list[tuple[int, int]]) -> None:
        """The child continues from the parent's state: a copy of its slot (applied before the next forward),
        or the parent's slot itself when the parent ends now and this is its last child."""
        if parent.state_slot is None:
            raise RuntimeError(f"{parent} forks but holds no state slot")
        if take_over:
            child.state_slot, parent.state_slot = parent.state_slot, None
            return
        child.state_slot = self.pool.allocate()
        pending_copies.append((parent.state_slot, child.state_slot))
