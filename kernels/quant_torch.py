"""Torch reference for quantized weights: unpack codes, dequantize, and the dequantize-then-matmul linear.

One in-memory layout serves every int checkpoint family (the loader converts to it once): `qweight` int32
[K / pack, N] with `pack = 32 // bits` codes per word along the input dim K, lowest bits first; `scales`
[groups, N]; `zeros` [groups, N] unsigned zero points, so a weight is (code - zero) * scale; an optional
`g_idx` [K] gives each input row's group (act order), otherwise row k is in group k // group_size. FP8
weights stay [N, K] float8_e4m3fn with one scale per output channel [N], or block-wise (Qwen3-*-FP8,
DeepSeek) one scale per output row and `group_size` input columns [N, ceil(K / group_size)] (the loader
repeats each block's scale over its rows, so tensor-parallel slicing stays row-wise). MXFP4 weights (OCP Microscaling, gpt-oss's
experts) stay [N, K / 2] bytes of two FP4 E2M1 codes each (element 2j in the low nibble, 2j+1 in the high one)
with one E8M0 byte per 32 input values, [N, K / 32]: a weight is e2m1(code) * 2**(scale - 127). This is the CPU
path and the oracle the Triton kernels are tested against; it imports nothing of ours.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ gemm: nibble i of a word holds column AWQ_PACK_ORDER[i]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes (int32, 0..2**bits-1) from words packed along `dim`, lowest bits first; that dim grows by 32 // bits."""
    dim = dim % packed.dim()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    shifts = shifts.view(-1, *[1] * (packed.dim() - dim - 1))  # on a new axis right after `dim`
    codes = (packed.unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(dim, dim + 1)


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `unpack_int32`: codes along `dim` (a multiple of 32 // bits long) into int32 words."""
    pack = 32 // bits
    moved = codes.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % pack:
        raise ValueError(f"cannot pack {moved.shape[-1]} codes into words of {pack}")
    moved = moved.reshape(*moved.shape[:-1], -1, pack)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = (moved << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ gemm words [rows, N / 8] -> codes [rows, N], undoing its interleaved nibble order."""
    codes = unpack_int32(packed, 4, dim=1)
    rows, n = codes.shape
    inverse = torch.tensor(AWQ_PACK_ORDER).argsort()  # column j sits in nibble inverse[j]
    return codes.view(rows, n // 8, 8)[:, :, inverse].reshape(rows, n)


def group_index(num_rows: int, group_size: int, g_idx: torch.Tensor | None, device) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.long()
    if group_size == -1:
        return torch.zeros(num_rows, dtype=torch.long, device=device)
    return torch.arange(num_rows, device=device) // group_size


def dequantize_int(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                   g_idx: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float weight [N, K] from the packed layout: (code - zero) * scale, computed in float32."""
    codes = unpack_int32(qweight, bits, dim=0)  # [K, N]
    k, n = codes.shape
    size = k if group_size == -1 else group_size
    if g_idx is None and k % size == 0:  # contiguous groups: broadcast instead of gathering [K, N] scales
        grouped = codes.view(k // size, size, n) - zeros.to(torch.int32).unsqueeze(1)
        w = (grouped.to(torch.float32) * scales.to(torch.float32).unsqueeze(1)).view(k, n)
    else:
        groups = group_index(k, group_size, g_idx, codes.device)
        w = (codes - zeros.to(torch.int32)[groups]).to(torch.float32) * scales.to(torch.float32)[groups]
    return w.t().to(dtype)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values sharing one E8M0 scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float weight [N, K] from MXFP4 bytes [N, K / 2] and E8M0 scales [N, K / 32], computed in float32 (exact:
    an E2M1 value times a power of two)."""
    n, half = blocks.shape
    if scales.shape != (n, half * 2 // MXFP4_BLOCK):
        raise ValueError(f"MXFP4 scales of shape {tuple(scales.shape)} do not fit blocks {tuple(blocks.shape)} "
                         f"(one scale per {MXFP4_BLOCK} values: expected {(n, half * 2 // MXFP4_BLOCK)})")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    values = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).view(n, -1, MXFP4_BLOCK)
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).view(n, -1).to(dtype)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                   group_size: int = -1) -> torch.Tensor:
    """Float weight [N, K] from FP8 values [N, K] and one scale per output channel [N] (or [N, 1]), or per
    output row and `group_size` input columns [N, ceil(K / group_size)]."""
    n, k = weight.shape
    scale = scale.to(torch.float32).reshape(n, -1)
    if scale.shape[1] > 1:
        if group_size < 1 or scale.shape[1] != -(-k // group_size):
            raise ValueError(f"FP8 block scales of shape {tuple(scale.shape)} do not fit a weight of {n} x {k} "
                             f"in column blocks of {group_size}")
        scale = scale.repeat_interleave(group_size, dim=1)[:, :k]
    return (weight.to(torch.float32) * scale).to(dtype)


def int_linear_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                     group_size: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x @ W.T for a packed int weight: the reference of the W4A16/W8A16 GEMV and GEMM kernels."""
    return F.linear(x, dequantize_int(qweight, scales, zeros, bits, group_size, g_idx, x.dtype), bias)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None, group_size: int = -1) -> torch.Tensor:
    return F.linear(x, dequantize_fp8(weight, scale, x.dtype, group_size), bias)


def fp8_w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 weights times FP8 activations (dynamic per-token scales) on FP8 matrix units (sm_89+).

    `torch._scaled_mm` runs with unit scales and a float32 result, and the per-token and per-channel scales
    are applied after: the product of the scales factors out of every dot product, so this equals scaled
    FP8 arithmetic without needing row-wise scaling support. CUDA wants both dims of x a multiple of 16."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    x_scale = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
    xq = (x2.float() / x_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    if x.is_cuda and rows % 16:
        xq = torch.cat([xq, xq.new_zeros(16 - rows % 16, k)])
    one = torch.ones((), device=x.device)
    out = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)[:rows]
    out = (out * x_scale * scale.float().view(1, -1)).to(x.dtype)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
