"""Triton W4A16/W8A16 (and weight-only FP8) linear layers that read packed weights and dequantize in registers.

Two kernels over the packed layout of kernels/quant_torch.py (int32 words of 4- or 8-bit codes packed along
K, [groups, N] scales and zero points, optional g_idx; or FP8 e4m3 bytes [N, K] with per-channel scales [N]
or block-wise scales [N, K / group] per output row and block of `group` input columns):
- `quant_gemv_kernel`, for decode batches (up to GEMV_MAX_ROWS rows): split-K, one program per (N block,
  K slice) holding EVERY row of the batch, so each weight tile is loaded and dequantized once per call and
  applied to all rows (the grid does not grow with the rows); the K slices' fp32 partial sums are added by
  torch afterwards (deterministic, no atomics). A few rows multiply on the CUDA cores, more go through
  `tl.dot` with the rows padded to a 16-row tile.
- `quant_gemm_kernel`, for prefill: M x N tiles, each K step dequantizes a [BLOCK_K, BLOCK_N] weight tile to
  the activation dtype and feeds `tl.dot` (tensor cores).
FP8 bytes are decoded by integer bit manipulation (kernels/triton_fp8.py), so Ampere runs them too. Weights
never leave their packed form in memory; `quant_linear_triton` picks the kernel (`choose_quant_kernel`, the
one place that decides) and launches it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_fp8 import e4m3fn_to_float

# Up to this many rows take the GEMV. Both kernels read each weight tile once while the rows fit one M tile
# (the GEMM's BLOCK_M is 32), but the GEMM has only N / 64 programs, each walking all of K: 64 programs for a
# 4096-wide projection, fewer than a 4090 has SMs, so it cannot pull full bandwidth; the GEMV adds K slices
# to fill the card. Past 32 rows the GEMM has M tiles to spread and is compute-bound anyway (a 4-bit weight
# byte feeds 4 * rows FLOPs). Untuned: `python -m kernels.bench` prints both kernels at 1-64 rows.
GEMV_MAX_ROWS = 32
# From this many rows the GEMV multiplies by tl.dot (rows padded to 16) instead of CUDA-core FMAs: an 8-row tile
# would cost 8 FMAs per weight on top of about 6 operations of dequantization, more than a 3090's CUDA cores
# sustain while its memory streams 4-bit weights (about 1.9 T weights/s against 17.8 T instructions/s).
GEMV_DOT_ROWS = 5
GEMV_BLOCK_N, GEMV_BLOCK_K = 64, 32
GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_BLOCK_K = 32, 64, 32


@dataclass(frozen=True, slots=True)
class QuantKernel:
    name: str  # "gemv" or "gemm"
    block_m: int  # rows per program: the GEMV holds every row (padded to a power of two), the GEMM a 32-row tile
    use_dot: bool


def choose_quant_kernel(rows: int) -> QuantKernel:
    """The kernel and row tile for `rows` activation rows (also the warm-up's and compile check's key)."""
    if rows > GEMV_MAX_ROWS:
        return QuantKernel("gemm", GEMM_BLOCK_M, True)
    use_dot = rows >= GEMV_DOT_ROWS
    block_m = triton.next_power_of_2(max(rows, 1))
    return QuantKernel("gemv", max(16, block_m) if use_dot else block_m, use_dot)


@triton.jit
def dequant_tile(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, k_end, N, stride_wk, stride_wn,
                 stride_sg, stride_zg, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr,
                 WEIGHT_FP8: tl.constexpr):
    """Float32 weights [BLOCK_K, BLOCK_N] for input rows offs_k (< k_end) and output columns offs_n (< N).
    FP8: stride_sg is the scales' stride per output row and, for block scales (GROUP > 1), stride_zg their
    stride per block of GROUP input columns (FP8 has no zero points)."""
    mask = (offs_k[:, None] < k_end) & (offs_n[None, :] < N)
    if WEIGHT_FP8:
        byte = tl.load(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn, mask=mask, other=0)
        if GROUP == 1:
            scale = tl.load(scales_ptr + offs_n * stride_sg, mask=offs_n < N, other=0.0)[None, :]
        else:
            scale = tl.load(scales_ptr + offs_n[None, :] * stride_sg + (offs_k // GROUP)[:, None] * stride_zg,
                            mask=mask, other=0.0)
        return e4m3fn_to_float(byte) * scale
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
def gemv_program(k_per_split, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A GEMV program's rows (every row of the batch), output columns, K slice and its [k_start, k_end)."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    k_start = split * k_per_split
    return (tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N), split, k_start,
            tl.minimum(k_start + k_per_split, K))


@triton.jit
def gemm_program(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A GEMM program's M x N tile: its rows and output columns."""
    return tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M), tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def load_rows(x_ptr, offs_m, offs_k, stride_xm, M, k_end):
    """The activation tile [BLOCK_M, BLOCK_K]: rows offs_m (< M), columns offs_k (< k_end), zeros outside."""
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                   mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_end), other=0.0)


@triton.jit
def dot_acc(a, w, acc, IEEE_FP32: tl.constexpr):
    """acc + a @ w on the tensor cores; fp32 activations without TF32 rounding, so the result matches the torch
    reference."""
    if IEEE_FP32:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def gemv_acc(x, w, acc, USE_DOT: tl.constexpr, IEEE_FP32: tl.constexpr):
    """acc + x @ w for a decode tile whose float32 weights serve every row: tl.dot with the rows padded to a
    16-row tile, or CUDA-core FMAs for a few rows."""
    if USE_DOT:
        acc = dot_acc(x, w.to(x.dtype), acc, IEEE_FP32)
    else:
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    return acc


@triton.jit
def store_tile(ptr, acc, offs_m, offs_n, stride_m, M, N):
    """The [BLOCK_M, BLOCK_N] tile into rows offs_m (< M) and columns offs_n (< N), in the pointer's dtype."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(ptr + offs_m[:, None] * stride_m + offs_n[None, :], acc.to(ptr.dtype.element_ty), mask=mask)


# M (the batch's rows) and k_per_split change from step to step: no specialisation on their values, so a new
# batch size never compiles a new variant (the row tile BLOCK_M is the only row-dependent choice).
@triton.jit(do_not_specialize=["M", "k_per_split"])
def quant_gemv_kernel(x_ptr, w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, partial_ptr, M, N, K, k_per_split,
                      stride_xm, stride_wk, stride_wn, stride_sg, stride_zg, BITS: tl.constexpr,
                      GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, WEIGHT_FP8: tl.constexpr,
                      USE_DOT: tl.constexpr, IEEE_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n, split, k_start, k_end = gemv_program(k_per_split, K, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = load_rows(x_ptr, offs_m, offs_k, stride_xm, M, k_end)
        # Loaded and dequantized once, then applied to every row of the batch.
        w = dequant_tile(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, k_end, N, stride_wk, stride_wn,
                         stride_sg, stride_zg, BITS, GROUP, HAS_G_IDX, WEIGHT_FP8)
        acc = gemv_acc(x, w, acc, USE_DOT, IEEE_FP32)
    store_tile(partial_ptr + split * M * N, acc, offs_m, offs_n, N, M, N)


@triton.jit(do_not_specialize=["M"])
def quant_gemm_kernel(x_ptr, w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                      stride_wk, stride_wn, stride_sg, stride_zg, BITS: tl.constexpr, GROUP: tl.constexpr,
                      HAS_G_IDX: tl.constexpr, WEIGHT_FP8: tl.constexpr, IEEE_FP32: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n = gemm_program(BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = load_rows(x_ptr, offs_m, offs_k, stride_xm, M, K)
        w = dequant_tile(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, K, N, stride_wk, stride_wn,
                         stride_sg, stride_zg, BITS, GROUP, HAS_G_IDX, WEIGHT_FP8).to(a.dtype)
        acc = dot_acc(a, w, acc, IEEE_FP32)
    store_tile(out_ptr, acc, offs_m, offs_n, stride_om, M, N)


def gemv_splits(n: int, k: int, rows: int, weight_bits: int, target_programs: int = 256) -> int:
    """K slices so that N blocks x slices reaches about `target_programs`, each slice whole BLOCK_Ks, and the
    fp32 partial sums (written, then read back: 8 bytes per row and column per slice) stay within a quarter of
    the weight's own bytes (k * bits / 8 per column), which bounds the extra traffic of a many-row batch."""
    by_programs = target_programs // max(1, triton.cdiv(n, GEMV_BLOCK_N))
    by_traffic = (k * weight_bits) // (4 * 8 * 8 * max(1, rows))
    return max(1, min(triton.cdiv(k, GEMV_BLOCK_K), by_programs, by_traffic))


def quant_linear_triton(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                        g_idx: torch.Tensor | None, bits: int, group_size: int, out_features: int,
                        weight_fp8: bool = False, bias: torch.Tensor | None = None,
                        kernel: QuantKernel | None = None) -> torch.Tensor:
    """x [..., K] @ W.T for a packed int weight ([K / pack, N] words) or an FP8 weight ([N, K] bytes).

    `kernel` overrides `choose_quant_kernel` (the benchmark times both kernels at every row count)."""
    k, n = x.shape[-1], out_features
    zeros = zeros if zeros is not None else scales  # unused by the FP8 branch, any pointer will do
    strides_sz = (scales.stride(0), zeros.stride(0))
    if weight_fp8:
        weight = weight.view(torch.uint8)
        stride_wk, stride_wn = weight.stride(1), weight.stride(0)
        # GROUP 1: one scale per output channel (one compiled variant whatever the layer); else block scales
        # [N, K / group], their column stride passed where int weights pass the zero points' stride
        block = scales.dim() == 2 and scales.shape[1] > 1
        bits, group_size = 8, group_size if block else 1
        strides_sz = (scales.stride(0), scales.stride(1) if block else 0)
    else:
        stride_wk, stride_wn = weight.stride(0), weight.stride(1)
    g_idx_arg = g_idx if g_idx is not None else scales
    common = dict(BITS=bits, GROUP=group_size, HAS_G_IDX=g_idx is not None, WEIGHT_FP8=weight_fp8,
                  IEEE_FP32=x.dtype == torch.float32)
    strides = (stride_wk, stride_wn, *strides_sz)

    def gemv(grid, x2, partial, m, k_per_split, stride_xm, kernel):
        quant_gemv_kernel[grid](x2, weight, scales, zeros, g_idx_arg, partial, m, n, k, k_per_split, stride_xm,
                                *strides, USE_DOT=kernel.use_dot, BLOCK_M=kernel.block_m, BLOCK_N=GEMV_BLOCK_N,
                                BLOCK_K=GEMV_BLOCK_K, **common)

    def gemm(grid, x2, out, m, stride_xm):
        quant_gemm_kernel[grid](x2, weight, scales, zeros, g_idx_arg, out, m, n, k, stride_xm, out.stride(0),
                                *strides, BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K, **common)
    return launch_linear(x, n, bits, GEMV_BLOCK_K, kernel, gemv, gemm, bias)


def launch_linear(x: torch.Tensor, n: int, weight_bits: int, gemv_block_k: int, kernel: QuantKernel | None,
                  gemv, gemm, bias: torch.Tensor | None) -> torch.Tensor:
    """The launch every weight format shares (packed ints and FP8 here, GGUF blocks in kernels/triton_gguf.py):
    x as [M, K] rows, the kernel `choose_quant_kernel` picks (or `kernel`), the GEMV's K slices (whole
    `gemv_block_k`s) summed in fp32 afterwards or the GEMM's tiles, the bias, x's leading dims back. `gemv(grid,
    x2, partial, m, k_per_split, stride_xm, kernel)` and `gemm(grid, x2, out, m, stride_xm)` launch the format's
    kernels."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    kernel = kernel or choose_quant_kernel(m)
    # A one-row view may carry any row stride (torch calls it contiguous): pass K, so it is no new variant.
    stride_xm = x2.stride(0) if m > 1 else k
    if kernel.name == "gemv":
        assert kernel.block_m >= m, f"GEMV row tile {kernel.block_m} cannot hold {m} rows"
        splits = gemv_splits(n, k, m, weight_bits)
        k_per_split = triton.cdiv(triton.cdiv(k, splits), gemv_block_k) * gemv_block_k
        splits = triton.cdiv(k, k_per_split)
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        gemv((triton.cdiv(n, GEMV_BLOCK_N), splits), x2, partial, m, k_per_split, stride_xm, kernel)
        out = (partial[0] if splits == 1 else partial.sum(0)).to(x.dtype)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        gemm((triton.cdiv(m, GEMM_BLOCK_M), triton.cdiv(n, GEMM_BLOCK_N)), x2, out, m, stride_xm)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], n)
