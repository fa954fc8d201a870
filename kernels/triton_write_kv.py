"""Triton kernel that stores new tokens' K/V into the paged cache through ``slot_mapping``.

One program per new token writes all of that token's KV heads for both K and V; a negative slot is
skipped. FP8 caches arrive as ``uint8`` views and get ``x / scale`` saturated and rounded to nearest
even by bit manipulation (kernels/triton_fp8.py), byte-identical to kernels/attention_torch.py. Integer caches
(int8, packed int4) get their values and per-group scales written together (kernels/triton_kv_int.py), then
`k_scale`/`v_scale` are the scale tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_int_torch import is_int_kv
from kernels.triton_fp8 import FP8_FORMATS, float_to_fp8
from kernels.triton_kv_int import int_kv_constexprs, int_kv_group, int_write_constexprs, scale_strides, store_int_kv
from kernels.triton_scales import scale_tensor


@triton.jit
def _store_one(src_ptr, cache_ptr, scale_ptr, src_offsets, cache_offsets, mask,
               IS_FP8: tl.constexpr, MAN_BITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr):
    x = tl.load(src_ptr + src_offsets, mask=mask, other=0.0)
    if IS_FP8:
        x = x.to(tl.float32)
        # div_rn is IEEE division like torch's x / scale (plain `/` may be approximate); it does not broadcast.
        scaled = tl.math.div_rn(x, tl.zeros_like(x) + tl.load(scale_ptr))
        tl.store(cache_ptr + cache_offsets, float_to_fp8(scaled, MAN_BITS, BIAS, FP8_MAX), mask=mask)
    else:
        tl.store(cache_ptr + cache_offsets, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
                    stride_kc_block, stride_kc_tok, stride_kc_head, stride_vc_block, stride_vc_tok, stride_vc_head,
                    stride_ks_block, stride_ks_tok, stride_ks_head, stride_vs_block, stride_vs_tok, stride_vs_head,
                    num_kv_heads, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
                    MAN_BITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr, INT_BITS: tl.constexpr,
                    INT_GROUP: tl.constexpr, INT_QMAX: tl.constexpr, INT_BLOCK_G: tl.constexpr,
                    INT_BLOCK_E: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if INT_BITS != 0:  # the scale pointers are the scale tensors
        block, offset = tl.maximum(slot, 0) // BLOCK_SIZE, tl.maximum(slot, 0) % BLOCK_SIZE
        store_int_kv(key_ptr, k_cache_ptr, k_scale_ptr, token * stride_key_tok,
                     block * stride_kc_block + offset * stride_kc_tok, block * stride_ks_block + offset * stride_ks_tok,
                     stride_key_head, stride_kc_head, stride_ks_head, num_kv_heads, slot, HEAD_DIM, INT_GROUP,
                     INT_BITS, INT_QMAX, BLOCK_H, INT_BLOCK_G, INT_BLOCK_E)
        store_int_kv(value_ptr, v_cache_ptr, v_scale_ptr, token * stride_value_tok,
                     block * stride_vc_block + offset * stride_vc_tok, block * stride_vs_block + offset * stride_vs_tok,
                     stride_value_head, stride_vc_head, stride_vs_head, num_kv_heads, slot, HEAD_DIM, INT_GROUP,
                     INT_BITS, INT_QMAX, BLOCK_H, INT_BLOCK_G, INT_BLOCK_E)
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # slot is broadcast before comparing: the interpreter mis-types `tensor_mask & scalar_mask` as int32.
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM) & ((slot + 0 * heads) >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _store_one(key_ptr, k_cache_ptr, k_scale_ptr, token * stride_key_tok + heads * stride_key_head + dims,
               block * stride_kc_block + offset * stride_kc_tok + heads * stride_kc_head + dims, mask,
               IS_FP8, MAN_BITS, BIAS, FP8_MAX)
    _store_one(value_ptr, v_cache_ptr, v_scale_ptr, token * stride_value_tok + heads * stride_value_head + dims,
               block * stride_vc_block + offset * stride_vc_tok + heads * stride_vc_head + dims, mask,
               IS_FP8, MAN_BITS, BIAS, FP8_MAX)


def write_kv_cache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: torch.Tensor | float | None = None,
                          v_scale: torch.Tensor | float | None = None) -> None:
    """Store key/value ``[num_tokens, num_kv_heads, head_dim]`` at their slots of the paged cache."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and k_cache.shape == v_cache.shape, (key.shape, value.shape, k_cache.shape)
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    per_byte = 2 if k_cache.dtype == torch.uint8 else 1
    assert k_cache.shape[2:] == (num_kv_heads, head_dim // per_byte), \
        f"cache {tuple(k_cache.shape)} vs key {tuple(key.shape)}"
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous in key/value"
    if num_tokens == 0:
        return
    cache_dtype = k_cache.dtype
    constexprs = write_kv_constexprs(cache_dtype, num_kv_heads, head_dim, k_cache.shape[1],
                                     int_kv_group(k_cache, k_scale))
    if k_cache.dtype in FP8_FORMATS:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if is_int_kv(cache_dtype):
        k_scale_arg, v_scale_arg = k_scale, v_scale
    else:
        k_scale_arg, v_scale_arg = scale_tensor(k_scale, key.device), scale_tensor(v_scale, key.device)
    write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale_arg, v_scale_arg, key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *scale_strides(k_scale_arg), *scale_strides(v_scale_arg), num_kv_heads, **constexprs)


def write_kv_constexprs(cache_dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int,
                        int_group: int = 1) -> dict:
    """Compile-time parameters of write_kv_kernel (also used by kernels/compile_check.py); `int_group`: values per
    scale of an integer cache."""
    fmt = FP8_FORMATS.get(cache_dtype)
    return dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
                BLOCK_D=triton.next_power_of_2(head_dim), IS_FP8=fmt is not None,
                MAN_BITS=0 if fmt is None else fmt.man_bits, BIAS=0 if fmt is None else fmt.bias,
                FP8_MAX=0.0 if fmt is None else fmt.max, **int_kv_constexprs(cache_dtype, int_group),
                **int_write_constexprs(cache_dtype, head_dim, int_group))
