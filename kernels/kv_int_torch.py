"""Integer KV cache formats, the torch reference: int8, and int4 packed two values to a byte, each group of a token's
head sharing one fp32 scale.

A cache of these formats is a pair per layer: the values ``[num_blocks, block_size, num_kv_heads, head_dim]`` as int8
(``head_dim / 2`` bytes as uint8 for int4: value 2i in the low nibble, 2i + 1 in the high one) and the scales
``[num_blocks, block_size, num_kv_heads, head_dim / group]`` as float32. Quantization is symmetric per group:
``scale = max |x| / qmax`` (qmax 127, or 7: int4 uses -7..7), ``q = floor(x / scale + 1/2)`` clamped to ±qmax, with IEEE
division, so the Triton KV-write kernel (kernels/triton_write_kv.py) stores the same bytes; an all-zero group gets
scale 1. The dtype says the format: int8 is int8, uint8 is int4. Imports nothing of ours.
"""
from __future__ import annotations

import torch

INT_KV_DTYPES = (torch.int8, torch.uint8)
QMAX = {torch.int8: 127.0, torch.uint8: 7.0}


def is_int_kv(dtype: torch.dtype) -> bool:
    return dtype in INT_KV_DTYPES


def values_per_byte(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.uint8 else 1


def quantize_int(x: torch.Tensor, cache_dtype: torch.dtype, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[..., head_dim]`` -> (values ``[..., head_dim / values_per_byte]``, scales ``[..., head_dim / group]``)."""
    qmax = QMAX[cache_dtype]
    groups = x.float().unflatten(-1, (x.shape[-1] // group, group))
    amax = groups.abs().amax(-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.floor(groups / scale[..., None] + 0.5).clamp_(-qmax, qmax).to(torch.int8).flatten(-2)
    if cache_dtype == torch.int8:
        return q, scale
    nibbles = q.to(torch.uint8) & 0xF  # two's complement in 4 bits
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), scale


def dequantize_int(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse, in `dtype`: values ``[..., head_dim / values_per_byte]`` times their group's scale."""
    if values.dtype == torch.uint8:  # sign-extend each nibble: (v ^ 8) - 8
        low = ((values & 0xF) ^ 8).to(torch.int8) - 8
        high = ((values >> 4) ^ 8).to(torch.int8) - 8
        values = torch.stack([low, high], -1).flatten(-2)
    groups = values.float().unflatten(-1, (scale.shape[-1], values.shape[-1] // scale.shape[-1]))
    return (groups * scale[..., None]).flatten(-2).to(dtype)


def group_size(cache: torch.Tensor, scale: torch.Tensor) -> int:
    """Values per scale of an integer cache and its scales."""
    return cache.shape[-1] * values_per_byte(cache.dtype) // scale.shape[-1]
