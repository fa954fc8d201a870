"""Attention over the paged KV cache: write this step's K/V into their slots, then attend through block tables.

The batch layout travels explicitly in `AttentionMetadata` (no global context); a layer reads the block table
and slots of its KV cache group (`kv_group`, set when the cache is bound); the kernels come from
`kernels.get_attention_backend`, so the torch path (CPU) and the Triton path (CUDA) see identical inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import get_attention_backend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    # KV cache groups past the first (sliding-window models); None with one group. Dummy metadata (profiling,
    # warm-up) leaves them None: every layer then uses the first group's, which is fine for shapes.
    group_block_tables: torch.Tensor | None = None  # [num_groups - 1, num_seqs, max_blocks] int32
    group_slot_mappings: torch.Tensor | None = None  # [num_groups - 1, num_tokens] int64


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None,
                 backend: str = "torch") -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.sliding_window = sliding_window
        self.write_kv_cache, self.paged_attention = get_attention_backend(backend)
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = None
        self.kv_group = 0  # which KV cache group's block table this layer reads (engine/kv_cache_interface.py)

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
        """Per-tensor FP8 scales live on the device as 1-element tensors: kernels read them without a host
        sync and CUDA graphs capture them. 1.0 by default (FP8's relative precision does not depend on a
        scale; it only matters for values beyond ±448, which K/V activations do not reach)."""
        self.k_cache, self.v_cache = k_cache, v_cache
        self.k_scale = torch.full((1,), k_scale, dtype=torch.float32, device=k_cache.device)
        self.v_scale = torch.full((1,), v_scale, dtype=torch.float32, device=k_cache.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | None):
        """q: [T, H, D]; k, v: [T, Hkv, D]. Without metadata (profiling run) attention is skipped."""
        if meta is None or self.k_cache.numel() == 0:
            return q
        slot_mapping, block_tables = meta.slot_mapping, meta.block_tables
        if self.kv_group and meta.group_block_tables is not None:
            slot_mapping = meta.group_slot_mappings[self.kv_group - 1]
            block_tables = meta.group_block_tables[self.kv_group - 1]
        self.write_kv_cache(k, v, self.k_cache, self.v_cache, slot_mapping, self.k_scale, self.v_scale)
        return self.paged_attention(q, self.k_cache, self.v_cache, block_tables, meta.seq_lens,
                                    meta.query_start_loc, self.scale, self.sliding_window, self.k_scale,
                                    self.v_scale)
