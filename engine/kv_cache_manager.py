"""KVCacheManager: which physical blocks each sequence gets, prefix-cache hits, forks and copy-on-write.

It grows a sequence's block table on demand (only as far as the tokens scheduled this step), looks up
the longest cached run of full prompt blocks on admission, hashes blocks as they fill, and shares blocks
between sequences by ref count. A shared, partly filled block is copied before a sequence writes into it
(`pending_copies`, executed by the model runner before the forward).
"""
from __future__ import annotations

from engine.block_pool import Block, BlockPool, hash_block
from engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.pending_copies: list[tuple[int, int]] = []  # (src block id, dst block id)
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """Longest run of cached full blocks at the start of a fresh sequence (never its last token)."""
        if not self.enable_caching or seq.num_computed_tokens or seq.block_table:
            return []
        if seq.params.prompt_logprobs is not None:  # cached blocks never had their logits computed
            return []
        self._hash_full_blocks(seq, seq.num_tokens)
        hits: list[Block] = []
        for block_hash in seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: list[Block] = ()) -> bool:
        """Reserve blocks for `num_new_tokens` more tokens (after any prefix hit); False if they don't fit."""
        bs = self.block_size
        if not computed and seq.num_computed_tokens % bs:  # fast path: a decode inside its last block
            total = seq.num_computed_tokens + num_new_tokens
            if total <= len(seq.block_table) * bs and seq.block_table[-1].ref_count == 1:
                if self.enable_caching and total % bs == 0:
                    self._cache_full_blocks(seq, total)
                return True
        num_computed = seq.num_computed_tokens + len(computed) * bs
        total = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(seq.block_table) - len(computed)
        cow = self._needs_copy(seq, num_computed)
        revived = sum(1 for b in computed if b.ref_count == 0)  # cached free blocks leave the free queue
        if num_new_blocks + cow + revived > self.pool.num_free_blocks:
            return False
        if self.enable_caching and not seq.block_table:  # a fresh admission: count its prefix lookup
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(computed) * self.block_size
        if computed:
            self.pool.touch(computed)
            seq.block_table.extend(computed)
            seq.num_computed_tokens = num_computed
        if cow:
            self._copy_on_write(seq, num_computed // self.block_size)
        seq.block_table.extend(self.pool.get_new_blocks(max(0, num_new_blocks)))
        if self.enable_caching:
            self._cache_full_blocks(seq, total)
        return True

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, last block first, so its tail is evicted before its shared prefix.

        Blocks are hashed when their slots are allocated, before the forward that writes them; a sequence
        freed in between (preempted in the step that scheduled it) un-registers the blocks it never computed,
        so no later prefix hit can read their unwritten slots."""
        first_uncomputed = seq.num_computed_tokens // self.block_size
        for block in seq.block_table[first_uncomputed:seq.num_cached_blocks]:
            assert block.ref_count == 1, f"{block} is shared but was never computed"
            self.pool.uncache_block(block)
        self.pool.free_blocks(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's blocks by reference; later writes copy the shared partial block."""
        self.pool.touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_blocks = parent.num_cached_blocks

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _needs_copy(self, seq: Sequence, num_computed: int) -> bool:
        index = num_computed // self.block_size
        return (num_computed % self.block_size != 0 and index < len(seq.block_table)
                and seq.block_table[index].ref_count > 1)

    def _copy_on_write(self, seq: Sequence, index: int) -> None:
        shared = seq.block_table[index]
        fresh = self.pool.get_new_blocks(1)[0]
        self.pending_copies.append((shared.block_id, fresh.block_id))
        self.pool.free_blocks([shared])
        seq.block_table[index] = fresh

    def _hash_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        salt = seq.request.cache_salt
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], salt))

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks that will be full after this step become findable by their hash."""
        self._hash_full_blocks(seq, num_tokens)
        for i in range(seq.num_cached_blocks, num_tokens // self.block_size):
            block = seq.block_table[i]
            if block.block_hash is None:
                self.pool.cache_block(block, seq.block_hashes[i])
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_tokens // self.block_size)
