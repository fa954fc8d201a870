"""Triton GGUF linear layers: the weight stays in llama.cpp's blocks and is decoded in registers, tile by tile.

`gguf_tile` decodes a [BLOCK_K, BLOCK_N] tile of a GGUF weight ([N, K / QK * type_size] bytes, row n the weights of
output n) for one block format (a constexpr: Q8_0, Q4_0, IQ4_NL, Q4_K, Q5_K, Q6_K, IQ4_XS), with the layouts and
the operation order of kernels/gguf_torch.py: the float16 scales are rebuilt from their two bytes, K-quant 6-bit
scales and mins unpacked per 32-wide sub-block, IQ4 codes looked up in a 16-entry table. Two kernels use it, as the
int formats' do (kernels/triton_quant_linear.py, whose kernel choice and split-K sizing they share):
- `gguf_gemv_kernel` for decode batches: split-K, one program per (N block, K slice) holding every row of the
  batch, so each weight byte is read once per step; fp32 partial sums added by torch afterwards;
- `gguf_gemm_kernel` for prefill: M x N tiles, each K step decodes a weight tile and feeds `tl.dot`.
The fused MoE kernel (kernels/triton_moe.py) decodes its expert tiles with the same `gguf_tile`.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.gguf_torch import IQ4_VALUES, block_format
from kernels.triton_quant_linear import (GEMM_BLOCK_M, GEMM_BLOCK_N, GEMV_BLOCK_N, QuantKernel, dot_acc, gemm_program,
                                         gemv_acc, gemv_program, launch_linear, load_rows, store_tile)

GGUF_BLOCK_K = 32  # one K-quant sub-block; every format's scales are constant over an aligned 32


@functools.cache
def iq4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device)


@triton.jit
def _byte(base, offset, mask):
    return tl.load(base + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(base, offset, mask):
    """The little-endian float16 at `offset`, as float32."""
    bits = _byte(base, offset, mask) | (_byte(base, offset + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def gguf_tile(w_ptr, table_ptr, offs_k, offs_n, K, N, stride_wn, GGML_TYPE: tl.constexpr, TYPE_SIZE: tl.constexpr):
    """Float32 weights [BLOCK_K, BLOCK_N] for input columns offs_k (< K) and output rows offs_n (< N); TYPE_SIZE is
    the format's bytes per block."""
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    if GGML_TYPE == 39:  # MXFP4: an E8M0 byte, then 32 E2M1 codes (low nibbles first), ggml's doubled values
        j = (offs_k % 32)[:, None]
        base = w_ptr + offs_n[None, :] * stride_wn + (offs_k // 32 * TYPE_SIZE)[:, None]
        e = _byte(base, 0, mask)
        half = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        code = (_byte(base, 1 + j % 16, mask) >> (j // 16 * 4)) & 0xF
        m = code & 7
        doubled = tl.where(m < 4, m, (2 + (m & 1)) << ((m >> 1) - 1))
        value = half * tl.where(code >= 8, -doubled, doubled).to(tl.float32)
    elif GGML_TYPE == 8 or GGML_TYPE == 2 or GGML_TYPE == 20:  # Q8_0, Q4_0, IQ4_NL: blocks of 32
        j = (offs_k % 32)[:, None]
        base = w_ptr + offs_n[None, :] * stride_wn + (offs_k // 32 * TYPE_SIZE)[:, None]
        d = _f16(base, 0, mask)
        if GGML_TYPE == 8:
            q = _byte(base, 2 + j, mask).to(tl.int8).to(tl.float32)
            value = q * d
        else:
            code = (_byte(base, 2 + j % 16, mask) >> (j // 16 * 4)) & 0xF
            if GGML_TYPE == 2:
                value = d * (code - 8).to(tl.float32)
            else:
                value = d * tl.load(table_ptr + code, mask=mask, other=0.0)
    else:  # super-blocks of 256
        j = (offs_k % 256)[:, None]
        s = j // 32
        lane = j % 32
        base = w_ptr + offs_n[None, :] * stride_wn + (offs_k // 256 * TYPE_SIZE)[:, None]
        if GGML_TYPE == 12 or GGML_TYPE == 13:  # Q4_K, Q5_K: 6-bit scale and min per sub-block
            low = tl.where(s < 4, s, s - 4)
            a = _byte(base, 4 + low, mask)
            b = _byte(base, 8 + low, mask)
            c = _byte(base, 12 + low, mask)
            sc = tl.where(s < 4, a & 63, (c & 0xF) | ((a >> 6) << 4))
            mn = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
            scale = _f16(base, 0, mask) * sc.to(tl.float32)
            offset = _f16(base, 2, mask) * mn.to(tl.float32)
            qs_start = 16 if GGML_TYPE == 12 else 48
            code = (_byte(base, qs_start + s // 2 * 32 + lane, mask) >> (s % 2 * 4)) & 0xF
            if GGML_TYPE == 13:
                code = code | (((_byte(base, 16 + lane, mask) >> s) & 1) << 4)
            value = scale * code.to(tl.float32) - offset
        elif GGML_TYPE == 14:  # Q6_K: 4 low bits + 2 high bits, int8 scale per 16
            half = j // 128
            t = (j % 128) // 32
            low = (_byte(base, half * 64 + t % 2 * 32 + lane, mask) >> (t // 2 * 4)) & 0xF
            high = (_byte(base, 128 + half * 32 + lane, mask) >> (2 * t)) & 0x3
            sc = _byte(base, 192 + j // 16, mask).to(tl.int8).to(tl.float32)
            scale = _f16(base, 208, mask) * sc
            value = scale * ((low | (high << 4)) - 32).to(tl.float32)
        else:  # IQ4_XS: 6-bit signed scale per sub-block, non-linear codes
            high_bits = _byte(base, 2, mask) | (_byte(base, 3, mask) << 8)
            ls = (_byte(base, 4 + s // 2, mask) >> (s % 2 * 4)) & 0xF
            hs = (high_bits >> (2 * s)) & 0x3
            scale = _f16(base, 0, mask) * ((ls | (hs << 4)) - 32).to(tl.float32)
            code = (_byte(base, 8 + s * 16 + lane % 16, mask) >> (lane // 16 * 4)) & 0xF
            value = scale * tl.load(table_ptr + code, mask=mask, other=0.0)
    return tl.where(mask, value, 0.0)


@triton.jit(do_not_specialize=["M", "k_per_split"])
def gguf_gemv_kernel(x_ptr, w_ptr, table_ptr, partial_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                     GGML_TYPE: tl.constexpr, TYPE_SIZE: tl.constexpr, USE_DOT: tl.constexpr, IEEE_FP32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n, split, k_start, k_end = gemv_program(k_per_split, K, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = load_rows(x_ptr, offs_m, offs_k, stride_xm, M, k_end)
        w = gguf_tile(w_ptr, table_ptr, offs_k, offs_n, k_end, N, stride_wn, GGML_TYPE, TYPE_SIZE)  # once, all rows
        acc = gemv_acc(x, w, acc, USE_DOT, IEEE_FP32)
    store_tile(partial_ptr + split * M * N, acc, offs_m, offs_n, N, M, N)


@triton.jit(do_not_specialize=["M"])
def gguf_gemm_kernel(x_ptr, w_ptr, table_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_wn,
                     GGML_TYPE: tl.constexpr, TYPE_SIZE: tl.constexpr, IEEE_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n = gemm_program(BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = load_rows(x_ptr, offs_m, offs_k, stride_xm, M, K)
        w = gguf_tile(w_ptr, table_ptr, offs_k, offs_n, K, N, stride_wn, GGML_TYPE, TYPE_SIZE).to(a.dtype)
        acc = dot_acc(a, w, acc, IEEE_FP32)
    store_tile(out_ptr, acc, offs_m, offs_n, stride_om, M, N)


def gguf_linear_triton(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None,
                       kernel: QuantKernel | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for a GGUF weight of bytes [N, K / QK * type_size] (rows contiguous); `kernel` overrides
    the GEMV / GEMM choice (the benchmark times both)."""
    fmt = block_format(ggml_type)
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] * fmt.block_size != k * fmt.type_size or weight.stride(1) != 1:
        raise ValueError(f"GGUF {fmt.name} weight of {tuple(weight.shape)} bytes (row stride {weight.stride(0)}) does "
                         f"not hold rows of {k} weights")
    table = iq4_table(x.device)
    common = dict(GGML_TYPE=ggml_type, TYPE_SIZE=fmt.type_size, IEEE_FP32=x.dtype == torch.float32)

    def gemv(grid, x2, partial, m, k_per_split, stride_xm, kernel):
        gguf_gemv_kernel[grid](x2, weight, table, partial, m, n, k, k_per_split, stride_xm, weight.stride(0),
                               USE_DOT=kernel.use_dot, BLOCK_M=kernel.block_m, BLOCK_N=GEMV_BLOCK_N,
                               BLOCK_K=GGUF_BLOCK_K, **common)

    def gemm(grid, x2, out, m, stride_xm):
        gguf_gemm_kernel[grid](x2, weight, table, out, m, n, k, stride_xm, out.stride(0), weight.stride(0),
                               BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GGUF_BLOCK_K, **common)
    return launch_linear(x, n, fmt.type_size * 8 // fmt.block_size or 4, GGUF_BLOCK_K, kernel, gemv, gemm, bias)
