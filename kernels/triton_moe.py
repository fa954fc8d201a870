"""Triton fused MoE: tokens sorted by expert, one grouped GEMM per projection, router weights in the epilogue.

The approach of vLLM's fused_moe, written for this layout (kernels/moe_torch.py): `moe_align_block_size`
sorts the flattened (token, choice) pairs by expert and pads each expert's run to a multiple of BLOCK_M, so
every M block of the sorted order belongs to one expert; `fused_moe_kernel` then multiplies each block's rows
by that expert's weight tile (one program per (M block, N block), weights read straight from the stacked
[E, N, K] tensor). The gate/up GEMM gathers rows of x; the activation runs between the two; the down GEMM adds
the expert's bias and multiplies by the router weight before storing, and the k choices of a token are summed.
The sort runs on the device with no host sync (CUDA graphs can capture it). A decode batch of up to 16 tokens
gives every expert at most 16 rows, one M block with the default tiles, so each chosen expert's weights are
read once per step. Imports nothing of ours.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.moe_torch import SWIGLU_ALPHA, SWIGLU_LIMIT, moe_activation


@dataclass(frozen=True, slots=True)
class MoETiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def default_moe_tiles(num_tokens: int, top_k: int, num_experts: int) -> MoETiles:
    """Untuned defaults by rows per expert; BLOCK_M 16 up to 16 tokens (an expert gets each token at most once,
    so one M block holds all its rows and its weights are read once). Shared memory stays under sm_86's 99 KB."""
    if num_tokens <= 16:
        return MoETiles(16, 64, 128, 1, 4, 4)
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 32:
        return MoETiles(32, 64, 64, 8, 4, 3)
    return MoETiles(64, 128, 64, 8, 8, 3)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) for the flattened routing table [T * k].

    sorted_token_ids [T*k + E*(block_m-1)] int32: entries grouped by expert, each group padded to a multiple of
    block_m with the sentinel T*k; expert_ids [blocks] int32: the expert of each M block (num_experts past the
    end); num_tokens_post_padded [1] int32: how many sorted slots are in use."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    # Not torch.bincount: on CUDA it reads the largest id on the host (a sync no CUDA graph can hold).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat.clamp(max=num_experts), torch.ones_like(flat))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[experts]
    capacity = n + num_experts * (block_m - 1)
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def fused_moe_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
                     num_tokens_post_padded_ptr, N, K, EM, num_valid_tokens, stride_am, stride_be, stride_bn,
                     stride_bk, stride_cm, stride_bias_e, TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, IEEE_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[rows of one expert's M block, N block] = A[rows] @ B[expert].T (+ bias) (* router weight)."""
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(EM, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)  # grouped ordering: neighbouring programs share weight tiles in L2
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % size_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // size_m
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_token = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (offs_token // TOP_K)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        if IEEE_FP32:  # fp32 activations: no TF32 rounding, so the result matches the torch reference
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & (offs_n[None, :] < N))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                 topk_weights: torch.Tensor | None, align, top_k: int, tiles: MoETiles) -> None:
    """out[entry] = a[entry // top_k] @ w[expert(entry)].T (+ bias) (* topk_weights[entry]) for every entry."""
    sorted_ids, expert_ids, num_post = align
    n, k = w.shape[1], w.shape[2]
    if a.shape[1] != k or a.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"grouped GEMM: activations {tuple(a.shape)} (inner stride {a.stride(1)}) do not match "
                         f"expert weights {tuple(w.shape)}")
    em = sorted_ids.numel()
    grid = (triton.cdiv(em, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    fused_moe_kernel[grid](
        a, w, out, bias if bias is not None else w, topk_weights if topk_weights is not None else w, sorted_ids,
        expert_ids, num_post, n, k, em, out.shape[0], a.stride(0), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), bias.stride(0) if bias is not None else 0, TOP_K=top_k,
        MUL_ROUTED_WEIGHT=topk_weights is not None, HAS_BIAS=bias is not None,
        IEEE_FP32=a.dtype == torch.float32, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
                     tiles: MoETiles | None = None) -> torch.Tensor:
    """Same contract as kernels.moe_torch.fused_moe_torch: [T, H] -> [T, H]."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    tiles = tiles or default_moe_tiles(num_tokens, top_k, num_experts)
    x = x.contiguous()
    align = moe_align_block_size(topk_ids, tiles.block_m, num_experts)
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gate_up, w13_bias, None, align, top_k, tiles)
    hidden = moe_activation(gate_up, activation, alpha, limit)
    out = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(hidden, w2, out, w2_bias, topk_weights.reshape(-1).to(torch.float32).contiguous(), align, 1,
                 tiles)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
