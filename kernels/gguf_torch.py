"""Torch reference for GGUF (llama.cpp) block formats: dequantize rows of blocks, and the dequantize-then-matmul linear.

A GGUF weight [N, K] is stored row by row; each row is K / QK blocks of `type_size` bytes (`block_format`:
QK = 32 for Q8_0, Q4_0, IQ4_NL and MXFP4, the 256-wide super-blocks of Q4_K, Q5_K, Q6_K and IQ4_XS, whose 32-wide
sub-blocks carry their own scales). Rows are independent, so a weight keeps the shape [N, K / QK * type_size] of
bytes, and a row slice (tensor-parallel output split, a gather of embedding rows) is a slice of that tensor.
Every decoder follows the `gguf` library's numpy reference operation by operation in float32, so the values are
bit for bit the same (tests/test_gguf_dequant.py); kernels/triton_gguf.py decodes the same layouts tile by tile.
This is the CPU path and the oracle of the Triton kernels; it imports nothing of ours.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str
    ggml_type: int  # llama.cpp's GGMLQuantizationType value, as stored in a GGUF tensor's header
    block_size: int  # weights per block (QK)
    type_size: int  # bytes per block


# The formats this engine reads (ggml type ids and sizes as llama.cpp's ggml.h / the `gguf` library give them).
BLOCK_FORMATS = {f.ggml_type: f for f in (
    BlockFormat("F32", 0, 1, 4), BlockFormat("F16", 1, 1, 2), BlockFormat("Q4_0", 2, 32, 18),
    BlockFormat("Q8_0", 8, 32, 34), BlockFormat("Q4_K", 12, 256, 144), BlockFormat("Q5_K", 13, 256, 176),
    BlockFormat("Q6_K", 14, 256, 210), BlockFormat("IQ4_NL", 20, 32, 18), BlockFormat("IQ4_XS", 23, 256, 136),
    BlockFormat("BF16", 30, 1, 2), BlockFormat("MXFP4", 39, 32, 17))}
FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: plain floats, one value a "block"
# IQ4_NL / IQ4_XS: a 4-bit code indexes this non-linear table (llama.cpp's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4 (gpt-oss's experts): E2M1 codes as doubled integers, times half the block's E8M0 scale (ggml's convention).
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def block_format(ggml_type: int) -> BlockFormat:
    if ggml_type not in BLOCK_FORMATS:
        raise ValueError(f"GGUF tensor type {ggml_type} has no decoder here; supported: "
                         f"{', '.join(f.name for f in BLOCK_FORMATS.values())}")
    return BLOCK_FORMATS[ggml_type]


def row_bytes(ggml_type: int, columns: int) -> int:
    """Bytes of one row of `columns` weights; `columns` must be whole blocks."""
    fmt = block_format(ggml_type)
    if columns % fmt.block_size:
        raise ValueError(f"a {fmt.name} row of {columns} weights is not whole blocks of {fmt.block_size}")
    return columns // fmt.block_size * fmt.type_size


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes [n, m] -> 4-bit codes [n, m * 2] in ggml's order: in each run of `group` bytes, every low nibble,
    then every high nibble."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, group)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).view(1, 1, 2, 1)
    return ((runs >> shifts) & 0x0F).reshape(n, -1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 16).view(torch.int8) - 8
    return _f16(b, 0) * q.to(torch.float32)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=b.device)
    return _f16(b, 0) * table[_nibbles(b[:, 2:], 16).long()]


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mins = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc.to(torch.float32)).view(n, 8, 1)
    dm = (_f16(b, 2) * mins.to(torch.float32)).view(n, 8, 1)
    q = _nibbles(b[:, 16:], 32).view(n, 8, 32).to(torch.float32)
    return (d * q - dm).view(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mins = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc.to(torch.float32)).view(n, 8, 1)
    dm = (_f16(b, 2) * mins.to(torch.float32)).view(n, 8, 1)
    low = _nibbles(b[:, 48:], 32).view(n, 8, 32)
    bit = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    high = (b[:, 16:48].reshape(n, 1, 32) >> bit) & 0x01  # sub-block s takes bit s of each qh byte
    q = (low | (high << 4)).to(torch.float32)
    return (d * q - dm).view(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (_f16(b, 208) * scales).view(n, 16, 1)
    low = _nibbles(b[:, :128], 64).view(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).view(n, 8, 32)
    q = (low | (high << 4)).view(torch.int8) - 32
    return (d * q.view(n, 16, 16).to(torch.float32)).view(n, 256)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    high_bits = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    low = _nibbles(b[:, 4:8], 1).view(n, 8)  # sub-block 2j: low nibble of byte j, 2j + 1: its high nibble
    high = (high_bits >> torch.arange(0, 16, 2, device=b.device).view(1, 8)) & 0x03
    scales = (low.to(torch.int32) | (high << 4)) - 32
    dl = (_f16(b, 0) * scales.to(torch.float32)).view(n, 8, 1)
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=b.device)
    q = table[_nibbles(b[:, 8:], 16).long()].view(n, 8, 32)
    return (dl * q).view(n, 256)


# Weights dequantized per F.linear call on the CPU path: 2 MiB of float32. Dequantizing a 4096 x 4096 Q8_0 (Q4_K)
# matrix whole took 203 (349) ms for one decode row on a shared 2-core box; 128 rows at a time 17 (67) ms; the
# float matrix kept dequantized 8 ms (BENCHMARKS.md, GGUF on CPU).
CHUNK_WEIGHTS = 1 << 19
def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """Half of 2^(e - 127) for E8M0 bytes, exactly as ggml's ggml_e8m0_to_fp32_half builds the float32 bits."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_DOUBLED, dtype=torch.float32, device=b.device)
    return e8m0_half(b[:, :1]) * table[_nibbles(b[:, 1:], 16).long()]


DECODERS = {2: _q4_0, 8: _q8_0, 12: _q4_k, 13: _q5_k, 14: _q6_k, 20: _iq4_nl, 23: _iq4_xs, 39: _mxfp4}


def dequantize_gguf(data: torch.Tensor, ggml_type: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float weights [..., K] from GGUF bytes [..., K / QK * type_size] (uint8; F32/F16/BF16 may also come as
    their own dtype), computed in float32 as the `gguf` library's reference does."""
    fmt = block_format(ggml_type)
    if data.dtype != torch.uint8:
        return data.to(dtype)
    if data.shape[-1] % fmt.type_size:
        raise ValueError(f"{fmt.name} rows of {data.shape[-1]} bytes are not whole blocks of {fmt.type_size}")
    lead, columns = data.shape[:-1], data.shape[-1] // fmt.type_size * fmt.block_size
    if ggml_type == 0:
        values = data.contiguous().view(torch.float32)
    elif ggml_type == 1:
        values = data.contiguous().view(torch.float16).to(torch.float32)
    elif ggml_type == 30:
        values = (data.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    else:
        values = DECODERS[ggml_type](data.reshape(-1, fmt.type_size))
    return values.reshape(*lead, columns).to(dtype)


def gguf_linear_torch(x: torch.Tensor, weight: torch.Tensor, ggml_type: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T for a GGUF weight of bytes [N, K / QK * type_size]: the reference of the Triton GEMV and GEMM, and
    the CPU path. Output rows go CHUNK_WEIGHTS at a time: each chunk's float weights stay in cache instead of
    a whole matrix's worth of fresh float32 temporaries per decoder step."""
    rows = max(1, CHUNK_WEIGHTS // x.shape[-1])
    if weight.shape[0] <= rows:
        return F.linear(x, dequantize_gguf(weight, ggml_type, x.dtype), bias)
    out = torch.cat([F.linear(x, dequantize_gguf(weight[i:i + rows], ggml_type, x.dtype))
                     for i in range(0, weight.shape[0], rows)], dim=-1)
    return out if bias is None else out + bias
