"""Triton W4A16/W8A16 (and weight-only FP8) linear layers that read packed weights and dequantize in registers.

Two kernels over the packed layout of kernels/quant_torch.py (int32 words of 4- or 8-bit codes packed along
K, [groups, N] scales and zero points, optional g_idx; or FP8 e4m3 bytes [N, K] with per-channel scales):
- `quant_gemv_kernel`, for decode batches (a few rows): split-K, one program per (row, N block, K slice), so
  enough programs stream the weight even at batch 1; the K slices' fp32 partial sums are added by torch
  afterwards (deterministic, no atomics).
- `quant_gemm_kernel`, for prefill: M x N tiles, each K step dequantizes a [BLOCK_K, BLOCK_N] weight tile to
  the activation dtype and feeds `tl.dot` (tensor cores).
FP8 bytes are decoded by integer bit manipulation (kernels/triton_fp8.py), so Ampere runs them too. Weights
never leave their packed form in memory; `quant_linear_triton` picks the kernel and launches it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_fp8 import e4m3fn_to_float

GEMV_MAX_ROWS = 16  # up to this many activation rows take the split-K GEMV


@triton.jit
def dequant_tile(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, k_end, N, stride_wk, stride_wn,
                 stride_sg, stride_zg, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr,
                 WEIGHT_FP8: tl.constexpr):
    """Float32 weights [BLOCK_K, BLOCK_N] for input rows offs_k (< k_end) and output columns offs_n (< N)."""
    mask = (offs_k[:, None] < k_end) & (offs_n[None, :] < N)
    if WEIGHT_FP8:
        byte = tl.load(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn, mask=mask, other=0)
        scale = tl.load(scales_ptr + offs_n, mask=offs_n < N, other=0.0)
        return e4m3fn_to_float(byte) * scale[None, :]
    PACK: tl.constexpr = 32 // BITS
    words = tl.load(w_ptr + (offs_k // PACK)[:, None] * stride_wk + offs_n[None, :] * stride_wn, mask=mask,
                    other=0)
    codes = (words >> ((offs_k % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)
    if HAS_G_IDX:
        groups = tl.load(g_idx_ptr + offs_k, mask=offs_k < k_end, other=0)
    else:
        groups = offs_k // GROUP
    scale = tl.load(scales_ptr + groups[:, None] * stride_sg + offs_n[None, :], mask=mask, other=0.0)
    zero = tl.load(zeros_ptr + groups[:, None] * stride_zg + offs_n[None, :], mask=mask, other=0)
    return (codes - zero.to(tl.int32)).to(tl.float32) * scale


@triton.jit
def quant_gemv_kernel(x_ptr, w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, partial_ptr, M, N, K, k_per_split,
                      stride_xm, stride_wk, stride_wn, stride_sg, stride_zg, BITS: tl.constexpr,
                      GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, WEIGHT_FP8: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, split, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < k_end, other=0.0).to(tl.float32)
        w = dequant_tile(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, k_end, N, stride_wk, stride_wn,
                         stride_sg, stride_zg, BITS, GROUP, HAS_G_IDX, WEIGHT_FP8)
        acc += tl.sum(x[:, None] * w, axis=0)
    tl.store(partial_ptr + (split * M + row) * N + offs_n, acc, mask=offs_n < N)


@triton.jit
def quant_gemm_kernel(x_ptr, w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                      stride_wk, stride_wn, stride_sg, stride_zg, BITS: tl.constexpr, GROUP: tl.constexpr,
                      HAS_G_IDX: tl.constexpr, WEIGHT_FP8: tl.constexpr, IEEE_FP32: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = dequant_tile(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, K, N, stride_wk, stride_wn,
                         stride_sg, stride_zg, BITS, GROUP, HAS_G_IDX, WEIGHT_FP8).to(a.dtype)
        if IEEE_FP32:  # fp32 activations: no TF32 rounding, so the result matches the torch reference
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv_splits(n: int, k: int, rows: int, block_n: int, block_k: int, target_programs: int = 256) -> int:
    """K slices so that (N blocks x rows x slices) reaches about `target_programs`, each slice whole BLOCK_Ks."""
    programs = triton.cdiv(n, block_n) * rows
    return max(1, min(triton.cdiv(k, block_k), target_programs // max(1, programs)))


def quant_linear_triton(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                        g_idx: torch.Tensor | None, bits: int, group_size: int, out_features: int,
                        weight_fp8: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for a packed int weight ([K / pack, N] words) or an FP8 weight ([N, K] bytes)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m, n = x2.shape[0], out_features
    if weight_fp8:
        weight = weight.view(torch.uint8)
        stride_wk, stride_wn = weight.stride(1), weight.stride(0)
    else:
        stride_wk, stride_wn = weight.stride(0), weight.stride(1)
    zeros = zeros if zeros is not None else scales  # unused by the FP8 branch, any pointer will do
    g_idx_arg = g_idx if g_idx is not None else scales
    common = dict(BITS=bits, GROUP=group_size, HAS_G_IDX=g_idx is not None, WEIGHT_FP8=weight_fp8)
    strides = (stride_wk, stride_wn, scales.stride(0), zeros.stride(0))
    if m <= GEMV_MAX_ROWS:
        block_n, block_k = 64, 32
        splits = gemv_splits(n, k, m, block_n, block_k)
        k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
        splits = triton.cdiv(k, k_per_split)
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(n, block_n), splits, m)
        quant_gemv_kernel[grid](x2, weight, scales, zeros, g_idx_arg, partial, m, n, k, k_per_split, x2.stride(0),
                                *strides, BLOCK_N=block_n, BLOCK_K=block_k, **common)
        out = partial.sum(0).to(x.dtype)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        block_m, block_n, block_k = 32, 64, 32
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        quant_gemm_kernel[grid](x2, weight, scales, zeros, g_idx_arg, out, m, n, k, x2.stride(0), out.stride(0),
                                *strides, IEEE_FP32=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
                                BLOCK_K=block_k, **common)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], n)
