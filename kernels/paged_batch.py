"""Random paged-attention batches for kernel tests and the kernel benchmark.

``make_paged_batch`` lays sequences out like the engine does: shuffled physical blocks in a pool with
spare blocks, unused block-table entries holding an out-of-range id, and every slot no sequence owns
filled with NaN (so a kernel that reads outside its sequence shows it). The context tokens are already
in the cache; the new tokens' K/V and their slot_mapping are returned for the caller to write.
Integer caches (int8, int4 as uint8) come with their scale tensors, NaN where no token was written (`int_group`
values per scale: head_dim for int8 and 16 for int4 by default). The dense per-sequence K/V (as the cache will hold
them, i.e. after any FP8 or integer round trip) come along for
oracles that do not page. `free_blocks_behind_window` then points every table entry wholly behind a
sliding window at a spare NaN block, as the engine's window groups free them. Imports nothing of ours outside
kernels/.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_torch import dequantize, is_fp8, quantize_fp8, write_kv_cache_torch
from kernels.kv_int_torch import dequantize_int, is_int_kv, quantize_int, values_per_byte


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    new_key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], not yet in the cache
    new_value: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens] int64
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], context tokens written
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    dense_keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim] as stored (dequantized)
    dense_values: list[torch.Tensor]
    k_scale: float | torch.Tensor | None  # FP8: per tensor; integer caches: the scale tensor
    v_scale: float | torch.Tensor | None


def make_paged_batch(query_lens: list[int], seq_lens: list[int], num_kv_heads: int, group: int, head_dim: int,
                     block_size: int = 16, dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None,
                     device: torch.device | str = "cpu", spare_blocks: int = 3,
                     int_group: int | None = None) -> PagedBatch:
    """Everything is created on `device` (the benchmark builds large batches straight on the GPU)."""
    assert all(0 <= q <= s for q, s in zip(query_lens, seq_lens)), (query_lens, seq_lens)
    cache_dtype = cache_dtype or dtype
    block_tables, num_blocks = _shuffled_block_tables(seq_lens, block_size, spare_blocks)
    block_tables = block_tables.to(device)
    k_cache = _nan_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device)
    v_cache = _nan_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device)
    if is_int_kv(cache_dtype):
        per_scale = int_group or (head_dim if cache_dtype == torch.int8 else 16)
        k_scale, v_scale = (torch.full((num_blocks, block_size, num_kv_heads, head_dim // per_scale), float("nan"),
                                       device=device) for _ in range(2))
    else:
        k_scale = v_scale = 0.25 if is_fp8(cache_dtype) else None
    keys = [torch.randn(s, num_kv_heads, head_dim, device=device).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, device=device).to(dtype) for s in seq_lens]
    slots = [_slots(block_tables[i], s, block_size) for i, s in enumerate(seq_lens)]
    context = [s - q for q, s in zip(query_lens, seq_lens)]
    write_kv_cache_torch(torch.cat([k[:c] for k, c in zip(keys, context)]),
                         torch.cat([v[:c] for v, c in zip(values, context)]), k_cache, v_cache,
                         torch.cat([sl[:c] for sl, c in zip(slots, context)]), k_scale, v_scale)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return PagedBatch(
        query=torch.randn(starts[-1], num_kv_heads * group, head_dim, device=device).to(dtype),
        new_key=torch.cat([k[c:] for k, c in zip(keys, context)]),
        new_value=torch.cat([v[c:] for v, c in zip(values, context)]),
        slot_mapping=torch.cat([sl[c:] for sl, c in zip(slots, context)]),
        k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        dense_keys=[_as_stored(k, cache_dtype, k_scale) for k in keys],
        dense_values=[_as_stored(v, cache_dtype, v_scale) for v in values],
        k_scale=k_scale, v_scale=v_scale)


def free_blocks_behind_window(batch: PagedBatch, sliding_window: int) -> int:
    """Point each table entry that no new token's window reaches at one spare block (NaN-filled, so a kernel
    that reads it shows it), like a freed block; returns how many entries were replaced."""
    block_size = batch.k_cache.shape[1]
    used = set(batch.block_tables[batch.block_tables < batch.k_cache.shape[0]].tolist())
    spare = next(b for b in range(batch.k_cache.shape[0]) if b not in used)
    starts = batch.query_start_loc.tolist()
    replaced = 0
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        first_visible = seq_len - (starts[seq + 1] - starts[seq]) - sliding_window + 1
        behind = max(0, first_visible) // block_size
        batch.block_tables[seq, :behind] = spare
        replaced += behind
    return replaced


def _shuffled_block_tables(seq_lens: list[int], block_size: int, spare_blocks: int) -> tuple[torch.Tensor, int]:
    """Each sequence gets distinct random physical blocks; unused entries hold an out-of-range id."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks).to(torch.int32)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), num_blocks + 7, dtype=torch.int32)
    taken = 0
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = physical[taken:taken + n]
        taken += n
    return block_tables, num_blocks


def _slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def _nan_cache(num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
               device: torch.device | str) -> torch.Tensor:
    shape = (num_blocks, block_size, heads, dim // values_per_byte(dtype))
    if is_int_kv(dtype):  # no NaN in integers: the scales are NaN where nothing was written
        return torch.zeros(shape, dtype=dtype, device=device)
    if is_fp8(dtype):  # 0x7f is NaN in both e4m3fn and e5m2
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _as_stored(x: torch.Tensor, cache_dtype: torch.dtype, scale) -> torch.Tensor:
    """What attention will read back for `x` (in x's dtype): the cache dtype round trip, FP8 or integer scales
    included."""
    if is_int_kv(cache_dtype):
        return dequantize_int(*quantize_int(x, cache_dtype, x.shape[-1] // scale.shape[-1]), x.dtype)
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype).to(x.dtype)
    return dequantize(quantize_fp8(x, scale, cache_dtype), scale, x.dtype)
