"""Integer KV caches inside the Triton kernels: the KV write quantizes a token's heads group by group, attention
reads values back times their group's scale. Same format and rounding as kernels/kv_int_torch.py (symmetric,
``floor(x / scale + 1/2)`` with IEEE division, int4 two values to a byte, low nibble first), so the bytes match.
`BITS` is 8 or 4; `GROUP` values share one fp32 scale.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_int_torch import QMAX, group_size, is_int_kv


def int_kv_constexprs(cache_dtype: torch.dtype, group: int) -> dict:
    """INT_BITS (0: not an integer cache) and INT_GROUP, for both kernels."""
    if not is_int_kv(cache_dtype):
        return dict(INT_BITS=0, INT_GROUP=1)
    return dict(INT_BITS=8 if cache_dtype == torch.int8 else 4, INT_GROUP=group)


def int_write_constexprs(cache_dtype: torch.dtype, head_dim: int, group: int) -> dict:
    """The KV write's: its own tile of groups (BLOCK_G) and of bytes per group (BLOCK_E), powers of two."""
    bits = int_kv_constexprs(cache_dtype, group)["INT_BITS"]
    per_byte = 2 if bits == 4 else 1
    return dict(INT_QMAX=QMAX.get(cache_dtype, 1.0), INT_BLOCK_G=triton.next_power_of_2(max(1, head_dim // group)),
                INT_BLOCK_E=triton.next_power_of_2(max(1, group // per_byte)))


def int_kv_group(cache: torch.Tensor, scales) -> int:
    """Values per scale of an integer cache (1 for any other: call before viewing an FP8 cache as uint8)."""
    return group_size(cache, scales) if is_int_kv(cache.dtype) else 1


def scale_strides(scales) -> tuple[int, int, int]:
    """(block, token, head) strides of an integer cache's scale tensor; zeros (never read) without one."""
    return tuple(scales.stride()[:3]) if isinstance(scales, torch.Tensor) and scales.dim() == 4 else (0, 0, 0)


@triton.jit
def store_int_kv(src_ptr, cache_ptr, scale_ptr, src_base, cache_base, scale_base, stride_src_head,
                 stride_cache_head, stride_scale_head, num_kv_heads, slot, HEAD_DIM: tl.constexpr,
                 GROUP: tl.constexpr, BITS: tl.constexpr, QMAX_: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token's heads: per group of GROUP values, scale = max |x| / qmax, values rounded and stored (int4: the
    even value in the low nibble), the scale beside them. Nothing is stored for a negative slot."""
    PER_BYTE: tl.constexpr = 8 // BITS
    GROUP_BYTES: tl.constexpr = GROUP // PER_BYTE
    heads = tl.arange(0, BLOCK_H)[:, None, None]
    groups = tl.arange(0, BLOCK_G)[None, :, None]
    elems = tl.arange(0, BLOCK_E)[None, None, :]
    # slot is broadcast before comparing: the interpreter mis-types `tensor_mask & scalar_mask` as int32.
    mask = (heads < num_kv_heads) & (groups < HEAD_DIM // GROUP) & (elems < GROUP_BYTES) & ((slot + 0 * heads) >= 0)
    first = src_base + heads * stride_src_head + groups * GROUP + elems * PER_BYTE
    x0 = tl.load(src_ptr + first, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x0), 2)
    if BITS == 4:
        x1 = tl.load(src_ptr + first + 1, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x1), 2))
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.zeros_like(amax) + QMAX_), 1.0)
    wide = tl.zeros_like(x0) + scale[:, :, None]
    q0 = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(x0, wide) + 0.5), -QMAX_), QMAX_)
    at = cache_base + heads * stride_cache_head + groups * GROUP_BYTES + elems
    if BITS == 8:
        tl.store(cache_ptr + at, q0.to(tl.int8), mask=mask)
    else:
        q1 = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(x1, wide) + 0.5), -QMAX_), QMAX_)
        packed = (q0.to(tl.int32) & 15) | ((q1.to(tl.int32) & 15) << 4)
        tl.store(cache_ptr + at, packed.to(tl.uint8), mask=mask)
    heads2 = tl.arange(0, BLOCK_H)[:, None]
    groups2 = tl.arange(0, BLOCK_G)[None, :]
    mask2 = (heads2 < num_kv_heads) & (groups2 < HEAD_DIM // GROUP) & ((slot + 0 * heads2) >= 0)
    tl.store(scale_ptr + scale_base + heads2 * stride_scale_head + groups2, scale, mask=mask2)


@triton.jit
def load_int_kv(cache_ptr, scale_ptr, offsets, scale_offsets, dims, mask, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Values at (row `offsets` / `scale_offsets`, value index `dims`), broadcast together, as float32; 0 where
    masked."""
    if BITS == 8:
        q = tl.load(cache_ptr + offsets + dims, mask=mask, other=0).to(tl.float32)
    else:
        byte = tl.load(cache_ptr + offsets + dims // 2, mask=mask, other=0).to(tl.int32)
        nibble = (byte >> ((dims % 2) * 4)) & 15
        q = ((nibble ^ 8) - 8).to(tl.float32)
    return q * tl.load(scale_ptr + scale_offsets + dims // GROUP, mask=mask, other=0.0)
