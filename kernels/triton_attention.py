"""The Triton attention backend: same signatures and results as kernels/attention_torch.py, on the GPU.

``write_kv_cache_triton`` is one launch (kernels/triton_write_kv.py). ``paged_attention_triton`` sends
a whole mixed batch (decodes and prefill chunks together) through ONE launch of the unified kernel in
kernels/triton_paged_attention.py, plus a small reduce launch when the KV range is split. Tiles and the
split count come from host-known shapes only (never from tensor values), so a call never syncs with the
GPU and can be captured in a CUDA graph: a batch whose token count equals its sequence count is treated
as decode-only (one token per program, 16-row tiles), anything else gets 64-row tiles (32 for
head_dim > 128); when the programs would not fill the GPU, each program's KV range is split
(flash-decoding) into a power-of-two number of pieces of at least 256 keys.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kernels.attention_torch import check_variants, is_fp8
from kernels.triton_fp8 import fp8_format_code
from kernels.triton_paged_attention import paged_attention_kernel, reduce_splits_kernel
from kernels.triton_scales import scale_tensor
from kernels.triton_write_kv import write_kv_cache_triton

__all__ = ["paged_attention_triton", "write_kv_cache_triton", "AttentionTiles", "choose_tiles", "device_facts",
           "launch_paged_attention", "attention_constexprs", "reduce_constexprs"]

MAX_SPLITS = 32
MIN_TILES_PER_SPLIT = 8  # 8 tiles of 32 tokens: at least 256 keys per split


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    block_m: int  # query rows per program: block_q tokens x GQA group heads, padded to a power of two
    block_q: int  # new tokens per program
    tile_n: int  # KV positions per loop iteration
    num_splits: int  # pieces each program's KV range is cut into (1 = no reduce launch)
    num_warps: int = 4
    num_stages: int = 1  # software-pipelining depth of the KV loop


@functools.lru_cache(maxsize=None)
def _device_facts(device: torch.device) -> tuple[int, int]:
    """(multiprocessor count, compute capability major); a small pretend Ampere for interpreter runs."""
    if device.type != "cuda":
        return 8, 8
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.major


def device_facts(device: torch.device) -> tuple[int, int]:
    """(multiprocessor count, compute capability major) of `device`: what `choose_tiles` reads."""
    return _device_facts(device)


def choose_tiles(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, head_dim: int,
                 max_kv_len: int, device: torch.device, facts: tuple[int, int] | None = None) -> AttentionTiles:
    """Untuned defaults picked from ptxas register/spill reports (no spills on sm_86 and sm_90 for
    head_dim <= 256); re-tune with `python -m kernels.bench` on the target card. `facts` (SM count, major):
    another card's, to key graphs on the tiles every tensor-parallel rank would choose."""
    num_sms, major = facts or _device_facts(device)
    decode_only = num_tokens == num_seqs
    rows = 16 if decode_only else (64 if head_dim <= 128 else 32)
    block_m = max(rows, triton.next_power_of_2(group))
    block_q = 1 if decode_only else block_m // group
    tile_n = 32 if head_dim <= 128 else 16
    num_stages = 3 if decode_only else (2 if major >= 9 else 1)
    programs = max(1, triton.cdiv(num_tokens, block_q) * num_kv_heads)
    num_splits = 1
    if programs < num_sms:
        by_length = triton.cdiv(max_kv_len, tile_n) // MIN_TILES_PER_SPLIT
        wanted = min(triton.cdiv(2 * num_sms, programs), by_length, MAX_SPLITS)
        num_splits = 1 << max(wanted, 1).bit_length() - 1  # power of two: few kernel variants
    return AttentionTiles(block_m, block_q, tile_n, num_splits, num_warps=8, num_stages=num_stages)


def paged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, sliding_window: int | None = None,
                           k_scale: torch.Tensor | float | None = None, v_scale: torch.Tensor | float | None = None,
                           *, soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                           key_limits: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cache; returns ``[num_tokens, heads, dim]``."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    tiles = choose_tiles(query.shape[0], seq_lens.shape[0], k_cache.shape[2], num_heads // k_cache.shape[2],
                         head_dim, block_tables.shape[1] * k_cache.shape[1], query.device)
    return launch_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                  sliding_window, k_scale, v_scale, tiles, soft_cap, sinks, key_limits)


def launch_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                           sliding_window, k_scale, v_scale, tiles: AttentionTiles, soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None, key_limits: torch.Tensor | None = None) -> torch.Tensor:
    """Run the unified kernel with explicit tiles (tests use this to cover split and tile variants)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads not a multiple of {num_kv_heads} KV heads"
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (k_cache.shape, query.shape)
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    assert query.stride(2) == 1, "head_dim must be contiguous in query"
    check_variants(num_heads, sliding_window, soft_cap, sinks)
    assert sinks is None or (sinks.device == query.device and sinks.is_contiguous()), "sinks: contiguous, on the GPU"
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    cache_dtype = k_cache.dtype
    if is_fp8(k_cache.dtype):
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    constexprs = attention_constexprs(query.dtype, cache_dtype, num_heads, num_kv_heads, head_dim,
                                      k_cache.shape[1], tiles, bool(sliding_window),
                                      large_pool=max(k_cache.numel(), v_cache.numel()) >= 2**31,
                                      soft_cap=soft_cap is not None, sinks=sinks is not None,
                                      key_limits=key_limits is not None)
    num_q_blocks = num_tokens if tiles.block_q == 1 else num_tokens // tiles.block_q + num_seqs
    partials = _split_buffers(num_tokens, num_heads, tiles.num_splits, constexprs["BLOCK_D"], query.device)
    k_scale_t, v_scale_t = scale_tensor(k_scale, query.device), scale_tensor(v_scale, query.device)
    paged_attention_kernel[(num_q_blocks, num_kv_heads, tiles.num_splits)](
        out, *partials, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        k_scale_t, v_scale_t, k_scale_t if sinks is None else sinks, seq_lens if key_limits is None else key_limits,
        float(scale), float(soft_cap or 1.0), num_seqs,
        num_heads, int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], **constexprs, num_warps=tiles.num_warps)
    if tiles.num_splits > 1:
        reduce_splits_kernel[(num_tokens, num_heads)](
            out, *partials, v_scale_t, num_heads, out.stride(0), out.stride(1),
            **reduce_constexprs(head_dim, tiles.num_splits))
    return out


def attention_constexprs(query_dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                         head_dim: int, block_size: int, tiles: AttentionTiles, use_window: bool,
                         large_pool: bool = False, soft_cap: bool = False, sinks: bool = False,
                         key_limits: bool = False) -> dict:
    """Compile-time parameters of paged_attention_kernel (also used by kernels/compile_check.py)."""
    group = num_heads // num_kv_heads
    assert tiles.block_q * group <= tiles.block_m, f"{tiles} cannot hold a GQA group of {group}"
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # dot: K >= 16
                BLOCK_SIZE=block_size, BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_q, TILE_N=tiles.tile_n,
                NUM_SPLITS=tiles.num_splits, USE_WINDOW=use_window, SOFT_CAP=soft_cap, USE_SINKS=sinks,
                KEY_LIMITS=key_limits,
                FP8_FORMAT=fp8_format_code(cache_dtype),
                IEEE=query_dtype == torch.float32, NUM_STAGES=tiles.num_stages,
                LARGE_POOL=large_pool)


def reduce_constexprs(head_dim: int, num_splits: int) -> dict:
    return dict(HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), NUM_SPLITS=num_splits,
                BLOCK_S=triton.next_power_of_2(num_splits))


def _split_buffers(num_tokens: int, num_heads: int, num_splits: int, block_d: int, device: torch.device):
    """Scratch for per-split (running max, running sum, unnormalised output); one element each when unused."""
    rows = num_tokens * num_heads * num_splits if num_splits > 1 else 1
    return (torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device),
            torch.empty(rows * block_d, dtype=torch.float32, device=device))
