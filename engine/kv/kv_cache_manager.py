"""KVCacheManager: which physical blocks each sequence gets, per KV cache group, from one shared pool.

The coordinator over one small manager per group (engine/kv/single_type_kv_cache_manager.py). It grows a
sequence's block tables on demand (only as far as the tokens scheduled this step; every group's table
has the same length), looks up the longest cached run of full prompt blocks on admission, hashes blocks
as they fill, and shares blocks between sequences by ref count. A shared, partly filled block is copied
before a sequence writes into it (`pending_copies`, executed by the model runner before the forward).
Sliding-window groups free blocks behind their window as a sequence grows.

A prefix hit must hold in every group: the full-attention groups give the longest cached prefix, each
window group then needs the blocks covering the window just before the hit's end (and lowers the hit
until it finds them); the full groups are cut to the common length (any prefix of their run is a hit).
A model with one full-attention group takes the same paths, with the same cost, as before groups existed.

A hybrid model (linear-attention layers) also has a state pool (`num_state_slots`): a sequence takes a slot
with its first blocks and gives it back when freed; a fork copies it (`pending_state_copies`, applied by the
model runner before the next forward, in order). A prefix hit must also restore the recurrent state at the
hit's end, so with prefix caching the pool keeps `num_snapshot_slots` state snapshots: when a prompt chunk
ends on a block boundary (the scheduler cuts prompt chunks there), the sequence's state is copied into a
snapshot keyed by that block's hash (the least recently used snapshot is evicted); a hit is lowered to the
latest block that has one, and the snapshot is copied into the new sequence's slot. Without snapshot slots a
hybrid model's prefix cache is never consulted.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

from engine.kv.block_pool import NULL_BLOCK, Block, BlockPool, hash_block
from engine.kv.kv_cache_interface import FULL_ATTENTION, FullAttentionSpec, KVSpec
from engine.kv.single_type_kv_cache_manager import StateManager, make_manager
from engine.kv.state_pool import StatePool


class Sequence(Protocol):
    """What the KV cache managers read and write of a sequence (engine/core/sequence.Sequence is the one the
    scheduler hands them): its block table per group, prefix hashes, state slot and computed tokens."""

    block_tables: list[list[Block]]
    block_hashes: list[bytes]
    num_cached_blocks: int
    state_slot: int | None
    num_computed_tokens: int
    num_prompt_tokens: int
    token_ids: list[int]
    params: Any  # SamplingParams: prompt_logprobs
    request: Any  # Request: cache_salt, pooling, mm (its images' spans and hashes)

    @property
    def num_tokens(self) -> int: ...

    @property
    def block_table(self) -> list[Block]: ...

    def mark_table_edit(self, group: int, index: int) -> None: ...


class KVCacheBlocks:
    """A prefix hit: per group, the blocks of the first `len(self)` table entries (NULL_BLOCK where a window
    group does not need one)."""

    __slots__ = ("blocks", "state_snapshot")

    def __init__(self, blocks: tuple[list[Block], ...], state_snapshot: int | None = None) -> None:
        self.blocks = blocks
        self.state_snapshot = state_snapshot  # hybrid models: the snapshot slot holding the state at the hit's end

    def __len__(self) -> int:
        return len(self.blocks[0])


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 group_specs: list[KVSpec] | None = None, num_state_slots: int = 0,
                 num_snapshot_slots: int = 0) -> None:
        """`group_specs`: one spec per KV cache group (engine/kv/kv_cache_interface.py); default one full group.
        `num_state_slots`: a hybrid model's state pool (max_num_seqs); 0 without linear-attention layers.
        `num_snapshot_slots`: its prefix-cache state snapshots, in the same pool after the seats' slots."""
        self.block_size = block_size
        self.state = StateManager(StatePool(num_state_slots + num_snapshot_slots)) if num_state_slots else None
        self.num_snapshot_slots = num_snapshot_slots if self.state is not None and enable_caching else 0
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> snapshot slot, oldest first
        if self.state is not None and not self.num_snapshot_slots:
            enable_caching = False  # a hit could not restore the recurrent state
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        specs = group_specs or [FullAttentionSpec(block_size, 1, 1, 1)]
        assert all(s.block_size == block_size for s in specs), "every group uses the pool's block size"
        self.managers = [make_manager(self.pool, spec, g) for g, spec in enumerate(specs)]
        self.num_groups = len(self.managers)
        self.window_managers = [m for m in self.managers if m.spec.kind != FULL_ATTENTION]
        self.pending_copies: list[tuple[int, int]] = []  # (src block id, dst block id)
        self.pending_state_copies: list[tuple[int, int]] = []  # (src state slot, dst state slot) of forks
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_tables(self) -> list[list[Block]]:
        """A fresh sequence's (empty) block table per group."""
        return [[] for _ in range(self.num_groups)]

    def get_computed_blocks(self, seq: Sequence) -> KVCacheBlocks | list:
        """Longest prefix of full blocks cached in every group for a fresh sequence (never its last token)."""
        if not self.enable_caching or seq.num_computed_tokens or seq.block_table:
            return []
        if seq.params.prompt_logprobs is not None:  # cached blocks never had their logits computed
            return []
        if seq.request.pooling is not None and seq.request.pooling.needs_every_token:  # mean/CLS: no hidden states
            return []
        self._hash_full_blocks(seq, seq.num_tokens)
        hashes = seq.block_hashes
        hit = (seq.num_tokens - 1) // self.block_size
        found: list[list[Block] | None] = [None] * self.num_groups
        for g, manager in enumerate(self.managers):  # full groups come first in the layout
            if manager.spec.kind == FULL_ATTENTION:
                found[g] = manager.find_longest_cache_hit(hashes, hit)
                hit = len(found[g])
        while self.window_managers and hit:  # each window group may lower the hit; stop when all agree
            lowered = hit
            for manager in self.window_managers:
                found[manager.group] = manager.find_longest_cache_hit(hashes, lowered)
                lowered = len(found[manager.group])
            if lowered == hit:
                break
            hit = lowered
        snapshot = None
        if self.state is not None:  # the hit ends where a state snapshot was kept
            while hit and hashes[hit - 1] not in self.snapshots:
                hit -= 1
            snapshot = self.snapshots[hashes[hit - 1]] if hit else None
        if not hit:
            return []
        return KVCacheBlocks(tuple(blocks[:hit] for blocks in found), snapshot)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: KVCacheBlocks | list = (),
                       num_lookahead_tokens: int = 0) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens (after any prefix hit), plus slots for
        `num_lookahead_tokens` speculative drafts, which are never hashed (they may be rejected); False if
        they don't fit."""
        bs = self.block_size
        tables = seq.block_tables
        # Fast path: a decode inside its last block (the tables exist: some tokens are computed). This runs for
        # most sequences every step, so one group keeps its own branch, with nothing more than before groups.
        if not computed and seq.num_computed_tokens % bs:
            total = seq.num_computed_tokens + num_new_tokens
            last = tables[0]
            if total + num_lookahead_tokens <= len(last) * bs and last[-1].ref_count == 1:
                # A block filled: decodes fill one token at a time, accepted drafts several at once.
                if self.num_groups == 1:
                    if self.enable_caching and total // bs > seq.num_cached_blocks:
                        self._cache_full_blocks(seq, total)
                    return True
                if all(t[-1].ref_count == 1 for t in tables):
                    for manager in self.window_managers:
                        manager.remove_skipped_blocks(seq, seq.num_computed_tokens)
                    if self.enable_caching and total // bs > seq.num_cached_blocks:
                        self._cache_full_blocks(seq, total)
                    return True
        if len(tables) != self.num_groups:  # a fresh sequence: one empty table per group
            tables = seq.block_tables = self.new_tables()
        num_hit = len(computed)
        hits = computed.blocks if num_hit else (None,) * self.num_groups
        num_computed = seq.num_computed_tokens + num_hit * bs
        total = num_computed + num_new_tokens
        for manager in self.window_managers:  # behind the window now: free before counting what is needed
            manager.remove_skipped_blocks(seq, seq.num_computed_tokens)
        num_new_blocks = self.blocks_needed(total + num_lookahead_tokens) - len(tables[0]) - num_hit
        cows = [m.needs_copy(seq, num_computed) for m in self.managers]
        # Cached free blocks of a hit leave the free queue; NULL_BLOCK never counts (never at zero).
        revived = sum(1 for blocks in hits for b in blocks if b.ref_count == 0) if num_hit else 0
        if max(0, num_new_blocks) * self.num_groups + sum(cows) + revived > self.pool.num_free_blocks:
            return False
        if self.state is not None and self.state.needs_slot(seq):  # a fresh admission: its state slot
            if self.state.pool.num_free <= self.num_snapshot_slots - len(self.snapshots):
                return False  # the free slots left are the snapshots' share
            self.state.allocate(seq)
            if num_hit and computed.state_snapshot is not None:  # continue from the state at the hit's end
                self.pending_state_copies.append((computed.state_snapshot, seq.state_slot))
                self.snapshots.move_to_end(seq.block_hashes[num_hit - 1])
        if self.enable_caching and not tables[0]:  # a fresh admission: count its prefix lookup
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_hit * bs
        if num_hit:
            for manager, hit in zip(self.managers, hits):
                manager.take_hit(seq, hit)
        for manager, cow in zip(self.managers, cows):
            manager.allocate(seq, num_computed, cow, num_new_blocks, self.pending_copies)
        seq.num_computed_tokens = num_computed
        if self.enable_caching:
            self._cache_full_blocks(seq, total)
        return True

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, last block first, so its tail is evicted before its shared prefix.

        Blocks are hashed when their slots are allocated, before the forward that writes them; a sequence
        freed in between (preempted in the step that scheduled it) un-registers the blocks it never computed,
        so no later prefix hit can read their unwritten slots."""
        first_uncomputed = seq.num_computed_tokens // self.block_size
        if len(seq.block_tables) != self.num_groups:  # never allocated anything
            seq.block_tables = self.new_tables()
        for manager in self.managers:
            manager.free(seq, first_uncomputed, seq.num_cached_blocks)
        if self.state is not None:
            self.state.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    def fork(self, parent: Sequence, child: Sequence, take_state: bool = False) -> None:
        """Give `child` the parent's blocks by reference in every group; later writes copy the shared partial
        block. A hybrid model's child also gets a copy of the parent's state slot, or with `take_state` (the
        parent ends this step, this is its last child) the slot itself."""
        if self.state is not None:
            self.state.fork(parent, child, take_state, self.pending_state_copies)
        child.block_tables = []
        for table in parent.block_tables:
            self.pool.touch(table)
            child.block_tables.append(list(table))
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_blocks = parent.num_cached_blocks

    def explain_misfit(self, num_computed_tokens: int, num_new_tokens: int) -> str:
        """Why a step of `num_new_tokens` after `num_computed_tokens` cannot fit even the empty pool: the blocks
        each group would hold. Every group draws on the one pool, so a window group's blocks count against
        the full groups' room (a block id is one page of each group's layers, not of every layer)."""
        total = num_computed_tokens + num_new_tokens
        parts = [f"{m.num_held_blocks_after(num_computed_tokens, total)} "
                 f"{'full' if m.spec.kind == FULL_ATTENTION else f'window-{m.spec.sliding_window}'}"
                 for m in self.managers]
        need = sum(m.num_held_blocks_after(num_computed_tokens, total) for m in self.managers)
        return (f"{total} tokens need {need} KV blocks of {self.block_size} tokens ({' + '.join(parts)}), "
                f"more than the pool's {self.pool.num_blocks}")

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def snapshot_state(self, seq: Sequence) -> None:
        """After a step: a prompt chunk that ended on a block boundary leaves its state as that block's snapshot
        (the copy runs before the next forward, so it sees exactly this step's state)."""
        bs, done = self.block_size, seq.num_computed_tokens
        if not self.num_snapshot_slots or done % bs or not done or done > seq.num_prompt_tokens \
                or seq.state_slot is None or len(seq.block_hashes) < done // bs:
            return
        key = seq.block_hashes[done // bs - 1]
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return
        if len(self.snapshots) >= self.num_snapshot_slots:
            _, slot = self.snapshots.popitem(last=False)  # the least recently used snapshot makes room
        else:
            slot = self.state.pool.allocate()
        self.snapshots[key] = slot
        self.pending_state_copies.append((seq.state_slot, slot))

    def take_state_copies(self) -> list[tuple[int, int]]:
        """Forks' state copies, for the forward about to run (it must apply them before anything writes)."""
        copies, self.pending_state_copies = self.pending_state_copies, []
        return copies

    def num_held_blocks(self, seq: Sequence) -> int:
        """Physical blocks a sequence's tables reference (window groups' freed entries not counted)."""
        return sum(1 for table in seq.block_tables for b in table if b is not NULL_BLOCK)

    def _hash_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        salt, mm = seq.request.cache_salt, getattr(seq.request, "mm", None)  # its images (engine/multimodal)
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else None
            images = mm.block_keys(i, bs) if mm is not None else ()
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], salt, images))

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks that will be full after this step become findable by their hash, in every group: those whose
        tokens are all known (under async scheduling a decode's input token may still be on the device; its
        block is cached at the sequence's next step)."""
        num_tokens = min(num_tokens, seq.num_tokens)
        self._hash_full_blocks(seq, num_tokens)
        last = num_tokens // self.block_size
        if last > seq.num_cached_blocks:
            for manager in self.managers:
                manager.cache_full_blocks(seq, seq.num_cached_blocks, last)
            seq.num_cached_blocks = last
