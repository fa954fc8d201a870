"""KV-cache byte counts: bytes per token and per block id (every cache slot of a model's KV cache groups, on one
card), the blocks a full-length sequence holds, the pool shared with a draft model's or MTP head's pages, a hybrid
model's state pool and its speculative verify scratch, and the --kv-cache-memory budget that holds a pool.

The group arithmetic itself is engine/kv/kv_cache_interface.py's (`model_kv_layout`); these are the quantities the
engine's KV sizing, the GUI's planner and the router's placement read from it, each counted here once. A block id
is one page in every cache slot; a draft model's cache (and an MTP head's) is addressed by the target's block ids,
so each block id costs the target's page and the draft's. Hybrid models (Gated DeltaNet layers) hold a fixed-size
state per seat instead (engine/kv/state_pool.py), which comes out of the same budget. Torch-free.
"""
from __future__ import annotations

from engine.config.model import ModelConfig
from engine.kv.kv_cache_interface import KVCacheLayout, cdiv, model_kv_layout


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype_bytes: int, tp: int = 1,
                       window_freeing: bool = True, act_dtype_bytes: int = 2) -> int:
    """K and V bytes of one block id on one card, over every cache slot (one per layer without sliding windows):
    KV heads are split across ranks, replicated below one each. A draft model's page, too (tp 1: it runs whole)."""
    return model_kv_layout(cfg, block_size, kv_dtype_bytes, tp, window_freeing, act_dtype_bytes).bytes_per_block


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype_bytes: int, tp: int = 1, block_size: int = 16,
                       window_freeing: bool = True) -> int:
    """One token position of a block id on one card (`kv_bytes_per_block` / block_size)."""
    return kv_bytes_per_block(cfg, block_size, kv_dtype_bytes, tp, window_freeing) // block_size


def blocks_with_draft(num_blocks: int, target_bytes_per_block: int, draft_bytes_per_block: int) -> int:
    """Blocks when every block id also holds a page of the draft model's KV: the pool sized for the target's pages
    alone, shared between both caches in proportion to their bytes per block."""
    if not draft_bytes_per_block:
        return num_blocks
    return num_blocks * target_bytes_per_block // (target_bytes_per_block + draft_bytes_per_block)


def blocks_per_full_seq(layout: KVCacheLayout, max_model_len: int, block_size: int,
                        max_num_batched_tokens: int) -> int:
    """Blocks one max_model_len sequence holds at its peak: one table of the context without sliding windows,
    else over every group (a window group's bound is its window plus one step's chunk)."""
    if layout.has_sliding_window:
        return layout.blocks_per_seq(max_model_len, max_num_batched_tokens)
    return cdiv(max_model_len, block_size)


def state_pool_bytes(layout: KVCacheLayout | None, max_num_seqs: int, enable_prefix_caching: bool = True) -> int:
    """A hybrid model's state pool on one card, its prefix-cache snapshots included (0 for attention-only
    models)."""
    return 0 if layout is None else layout.state_pool_bytes(max_num_seqs, enable_prefix_caching)


def kv_pool_budget_bytes(layout: KVCacheLayout, num_blocks: int, max_num_seqs: int, enable_prefix_caching: bool = True,
                         draft_kv_bytes_per_block: int = 0) -> int:
    """The --kv-cache-memory budget whose pool is `num_blocks` block ids: their pages (a draft's or MTP head's
    beside the target's) and a hybrid model's state pool, which that budget holds too (`plan_from_budget`)."""
    return num_blocks * (layout.bytes_per_block + draft_kv_bytes_per_block) + \
        state_pool_bytes(layout, max_num_seqs, enable_prefix_caching)


def verify_scratch_tokens(max_num_seqs: int, num_speculative_tokens: int, max_num_batched_tokens: int) -> int:
    """Tokens a hybrid model's verify scratch holds (rollback of rejected drafts, engine/spec_decode/
    state_rollback.py): every seat's 1 + k verify tokens, capped by the step's token budget; 0 without
    speculation. The engine reserves exactly this."""
    if num_speculative_tokens <= 0:
        return 0
    return min(max_num_seqs * (1 + num_speculative_tokens), max_num_batched_tokens)


def verify_scratch_bytes(layout: KVCacheLayout, max_num_seqs: int, num_speculative_tokens: int,
                         max_num_batched_tokens: int) -> int:
    """That scratch's bytes on one card over every linear-attention layer (0 for attention-only models): allocated
    before the KV pool is sized, so it sits beside the weights, outside the KV budget."""
    return layout.verify_scratch_bytes(verify_scratch_tokens(max_num_seqs, num_speculative_tokens,
                                                             max_num_batched_tokens))
