"""Triton fused MoE: tokens sorted by expert, one grouped GEMM per projection, router weights in the epilogue.

The approach of vLLM's fused_moe, written for this layout (kernels/moe_torch.py): `moe_align_block_size`
sorts the flattened (token, choice) pairs by expert and pads each expert's run to a multiple of BLOCK_M, so
every M block of the sorted order belongs to one expert; `fused_moe_kernel` then multiplies each block's rows
by that expert's weight tile (one program per (M block, N block), weights read straight from the stacked
[E, N, K] tensor). The gate/up GEMM gathers rows of x; the activation runs between the two; the down GEMM adds
the expert's bias and multiplies by the router weight before storing, and the k choices of a token are summed.
The sort runs on the device with no host sync (CUDA graphs can capture it). A decode batch of up to 16 tokens
gives every expert at most 16 rows, one M block with the default tiles, so each chosen expert's weights are
read once per step. Packed experts (W4A16/W8A16 int codes, GPTQ act order's g_idx included; FP8 e4m3 with
per-channel or block-wise scales; MXFP4; GGUF blocks, through kernels/triton_gguf.py's gguf_tile) are
dequantized tile by tile in registers before each dot (sm_86 has
no FP8/FP4 matrix units, and one W8A16 path serves sm_89 too), so they cross memory at 4 or 8 bits. Tiles come
from `moe_tiles`: a tuned table (kernels/moe_tuning.py, written by `pagedesk-bench moe-tune`) for this card
and shape when there is one, else `default_moe_tiles`. Imports only kernels/ modules.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.gguf_torch import block_format
from kernels.moe_torch import SWIGLU_ALPHA, SWIGLU_LIMIT, PackedExperts, moe_activation
from kernels.moe_tuning import MoETiles, default_moe_tiles, moe_tiles, shape_key
from kernels.triton_gguf import gguf_tile, iq4_table


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


FLOAT_WEIGHTS, INT_WEIGHTS, MXFP4_WEIGHTS, FP8_WEIGHTS, GGUF_WEIGHTS = 0, 1, 2, 3, 4  # the WEIGHT_FORMAT constexpr


@triton.jit
def mxfp4_tile(w_ptr, scales_ptr, offs_k, offs_n, K, N, stride_wn, stride_sn):
    """Float32 weights [BLOCK_K, BLOCK_N] from MXFP4 bytes [N, K / 2] (element 2j in the low nibble) and E8M0
    scales [N, K / 32], decoded by integer arithmetic (no FP4 instructions on sm_86/sm_89)."""
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    byte = tl.load(w_ptr + offs_n[None, :] * stride_wn + (offs_k // 2)[:, None], mask=mask, other=0).to(tl.int32)
    code = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    # E2M1 magnitude in quarters: subnormal 0/0.5 (exponent 0), else (1 + m/2) * 2**(exponent-1)
    quarters = tl.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent)
    magnitude = quarters.to(tl.float32) * 0.25
    value = tl.where((code & 0x8) != 0, -magnitude, magnitude)
    scale_byte = tl.load(scales_ptr + offs_n[None, :] * stride_sn + (offs_k // 32)[:, None], mask=mask,
                         other=127).to(tl.int32)
    scale = (scale_byte << 23).to(tl.float32, bitcast=True)  # E8M0 is a float32 exponent field: 2**(s - 127)
    return value * scale


@triton.jit
def fp8_tile(w_ptr, scales_ptr, k0, offs_n, K, N, stride_wn, stride_sn, stride_sg, GROUP: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """Float32 weights [BLOCK_K, BLOCK_N] for input rows k0.. from e4m3 bytes [N, K] (decoded by integer
    arithmetic: sm_86 has no FP8 instructions) and float32 scales [N, K / GROUP] per output row and block of
    GROUP input columns (stride_sg 0: one per row). A tile inside one block reads one row of scales."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    mask = (offs_k[:, None] < K) & n_mask[None, :]
    byte = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask, other=0).to(tl.uint16)
    # e4m3 -> fp16 by moving the bits: sign to bit 15, exponent and mantissa to bits 13..7 make an fp16 of
    # 2**-8 times the value, subnormals included (both formats' subnormals scale the same way); the 2**8 goes
    # into the scale. Three integer ops a weight, where the general decoder (kernels/triton_fp8.py, NaN-aware)
    # spilled registers on the decode tiles. Weights hold no NaN (0x7f/0xff would read as +-480).
    half = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
    value = half.to(tl.float16, bitcast=True).to(tl.float32)
    if GROUP % BLOCK_K == 0:
        scale = tl.load(scales_ptr + offs_n * stride_sn + (k0 // GROUP) * stride_sg, mask=n_mask, other=0.0)[None, :]
    else:
        scale = tl.load(scales_ptr + offs_n[None, :] * stride_sn + (offs_k // GROUP)[:, None] * stride_sg, mask=mask,
                        other=0.0)
    return value * (scale * 256.0)


@triton.jit
def int_tile(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k0, offs_n, K, N, stride_wk, stride_wn, stride_sg,
             stride_zg, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr):
    """Float32 weights [BLOCK_K, BLOCK_N] for input rows k0.. from int codes packed along K ([K / pack, N] words,
    lowest bits first) and [G, N] scales and unsigned zeros; under act order (HAS_G_IDX) row k's group is
    g_idx[k], so its scale and zero are gathered per row. Each word is loaded once and unpacked by shifts
    (not loaded once per code), and when a tile lies inside one group its scales and zeros are one row: both
    keep the registers of the decode tiles free of spills."""
    PACK: tl.constexpr = 32 // BITS
    offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    n_mask = offs_n < N
    words = tl.load(w_ptr + offs_w[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=(offs_w[:, None] < tl.cdiv(K, PACK)) & n_mask[None, :], other=0)
    shifts = tl.arange(0, PACK) * BITS
    codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, (BLOCK_K, words.shape[1]))  # row w * PACK + j holds code j of word w
    if HAS_G_IDX:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        groups = tl.load(g_idx_ptr + offs_k, mask=offs_k < K, other=0)
        g_mask = (offs_k < K)[:, None] & n_mask[None, :]
        scale = tl.load(scales_ptr + groups[:, None] * stride_sg + offs_n[None, :], mask=g_mask, other=0.0)
        zero = tl.load(zeros_ptr + groups[:, None] * stride_zg + offs_n[None, :], mask=g_mask, other=0)
    elif GROUP % BLOCK_K == 0:
        group = k0 // GROUP
        scale = tl.load(scales_ptr + group * stride_sg + offs_n, mask=n_mask, other=0.0)[None, :]
        zero = tl.load(zeros_ptr + group * stride_zg + offs_n, mask=n_mask, other=0)[None, :]
    else:
        groups = (k0 + tl.arange(0, BLOCK_K)) // GROUP
        g_mask = (k0 + tl.arange(0, BLOCK_K) < K)[:, None] & n_mask[None, :]
        scale = tl.load(scales_ptr + groups[:, None] * stride_sg + offs_n[None, :], mask=g_mask, other=0.0)
        zero = tl.load(zeros_ptr + groups[:, None] * stride_zg + offs_n[None, :], mask=g_mask, other=0)
    return (codes - zero.to(tl.int32)).to(tl.float32) * scale


@triton.jit
def fused_moe_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
                     num_tokens_post_padded_ptr, b_scales_ptr, b_zeros_ptr, b_g_idx_ptr, N, K, EM,
                     num_valid_tokens, stride_am, stride_be, stride_bn, stride_bk, stride_cm, stride_bias_e,
                     stride_se, stride_sn, stride_sg, stride_ze, stride_zg, stride_ge, TOP_K: tl.constexpr,
                     MUL_ROUTED_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE_FP32: tl.constexpr,
                     WEIGHT_FORMAT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr,
                     GGML_TYPE: tl.constexpr, TYPE_SIZE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[rows of one expert's M block, N block] = A[rows] @ B[expert].T (+ bias) (* router weight).

    B is float [E, N, K], or packed (WEIGHT_FORMAT): int codes [E, K / pack, N] with [E, G, N] scales and
    zeros (and [E, K] g_idx under act order), FP8 bytes [E, N, K] with [E, N, K / GROUP] scales, MXFP4
    bytes [E, N, K / 2] with [E, N, K / 32] scales, or GGUF blocks [E, N, K / QK * TYPE_SIZE] of ggml type
    GGML_TYPE (b_scales_ptr: the IQ4 table); a packed tile is dequantized in registers to A's dtype right before
    the dot, so the weights cross memory at 4 to 8 bits."""
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
    a_rows = a_ptr + (offs_token // TOP_K)[:, None] * stride_am
    b_expert = b_ptr + expert * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + offs_k[None, :], mask=token_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        if WEIGHT_FORMAT == 1:
            b = int_tile(b_expert, b_scales_ptr + expert * stride_se, b_zeros_ptr + expert * stride_ze,
                         b_g_idx_ptr + expert * stride_ge, k0, offs_n, K, N, stride_bk, stride_bn, stride_sg,
                         stride_zg, BITS, GROUP, HAS_G_IDX, BLOCK_K).to(a.dtype)
        elif WEIGHT_FORMAT == 3:
            b = fp8_tile(b_expert, b_scales_ptr + expert * stride_se, k0, offs_n, K, N, stride_bn, stride_sn,
                         stride_sg, GROUP, BLOCK_K).to(a.dtype)
        elif WEIGHT_FORMAT == 4:
            b = gguf_tile(b_expert, b_scales_ptr, offs_k, offs_n, K, N, stride_bn, GGML_TYPE, TYPE_SIZE).to(a.dtype)
        elif WEIGHT_FORMAT == 2:
            b = mxfp4_tile(b_expert, b_scales_ptr + expert * stride_se, offs_k, offs_n, K, N, stride_bn,
                           stride_sn).to(a.dtype)
        else:
            b = tl.load(b_expert + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                        mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if IEEE_FP32:  # fp32 activations: no TF32 rounding, so the result matches the torch reference
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & (offs_n[None, :] < N))


def weight_args(w) -> tuple[dict, dict, tuple[int, int, int]]:
    """(pointer and stride arguments, format constexprs, (E, N, K)) of a float [E, N, K] tensor or PackedExperts."""
    none = dict(stride_se=0, stride_sn=0, stride_sg=0, stride_ze=0, stride_zg=0, stride_ge=0)
    plain = dict(WEIGHT_FORMAT=FLOAT_WEIGHTS, BITS=16, GROUP=1, HAS_G_IDX=False, GGML_TYPE=0, TYPE_SIZE=1)
    if isinstance(w, torch.Tensor):
        return (dict(b=w, scales=w, zeros=w, g_idx=w, stride_be=w.stride(0), stride_bn=w.stride(1),
                     stride_bk=w.stride(2), **none), plain, tuple(w.shape))
    e, n, k = w.shape
    if w.format == "gguf":
        if w.weight.stride(2) != 1:
            raise ValueError(f"GGUF expert weights {tuple(w.weight.shape)} must be contiguous along their rows")
        table = iq4_table(w.weight.device)
        return (dict(b=w.weight, scales=table, zeros=table, g_idx=table, stride_be=w.weight.stride(0),
                     stride_bn=w.weight.stride(1), stride_bk=1, **none),
                dict(plain, WEIGHT_FORMAT=GGUF_WEIGHTS, GGML_TYPE=w.ggml_type,
                     TYPE_SIZE=block_format(w.ggml_type).type_size), (e, n, k))
    if w.format in ("mxfp4", "fp8"):
        weight = w.weight.view(torch.uint8)  # FP8 bytes are decoded by integer arithmetic
        if weight.stride(2) != 1:
            raise ValueError(f"{w.format} expert weights {tuple(weight.shape)} must be contiguous along K")
        if w.format == "fp8" and (w.scales.shape[:2] != (e, n) or w.scales.shape[2] != -(-k // w.group_size)):
            raise ValueError(f"FP8 expert scales {tuple(w.scales.shape)} do not fit weights {(e, n, k)} in column "
                             f"blocks of {w.group_size}")
        one_block = w.format == "fp8" and w.scales.shape[2] == 1  # per channel: any GROUP, one compiled variant
        args = dict(b=weight, scales=w.scales, zeros=w.scales, g_idx=w.scales, stride_be=weight.stride(0),
                    stride_bn=weight.stride(1), stride_bk=1, **none | dict(
                        stride_se=w.scales.stride(0), stride_sn=w.scales.stride(1),
                        stride_sg=0 if one_block else w.scales.stride(2)))
        fmt = (dict(WEIGHT_FORMAT=MXFP4_WEIGHTS, BITS=4, GROUP=32) if w.format == "mxfp4" else
               dict(WEIGHT_FORMAT=FP8_WEIGHTS, BITS=8, GROUP=128 if one_block else w.group_size))
        return args, fmt | dict(HAS_G_IDX=False, GGML_TYPE=0, TYPE_SIZE=1), (e, n, k)
    if w.scales.stride(2) != 1 or w.zeros.stride(2) != 1:
        raise ValueError("int expert scales and zeros must be contiguous along N")
    g_idx = w.g_idx
    if g_idx is not None and (g_idx.shape != (e, k) or g_idx.stride(1) != 1):
        raise ValueError(f"int expert g_idx {tuple(g_idx.shape)} must be [experts, K] = {(e, k)}, contiguous")
    args = dict(b=w.weight, scales=w.scales, zeros=w.zeros, g_idx=w.scales if g_idx is None else g_idx,
                stride_be=w.weight.stride(0), stride_bn=w.weight.stride(2), stride_bk=w.weight.stride(1),
                stride_se=w.scales.stride(0), stride_sn=1, stride_sg=w.scales.stride(1),
                stride_ze=w.zeros.stride(0), stride_zg=w.zeros.stride(1),
                stride_ge=0 if g_idx is None else g_idx.stride(0))
    return args, dict(WEIGHT_FORMAT=INT_WEIGHTS, BITS=w.bits, GROUP=w.group_size, HAS_G_IDX=g_idx is not None,
                      GGML_TYPE=0, TYPE_SIZE=1), (e, n, k)


def grouped_gemm(a: torch.Tensor, w, out: torch.Tensor, bias: torch.Tensor | None,
                 topk_weights: torch.Tensor | None, align, top_k: int, tiles: MoETiles) -> None:
    """out[entry] = a[entry // top_k] @ w[expert(entry)].T (+ bias) (* topk_weights[entry]) for every entry;
    `w` a float [E, N, K] tensor or PackedExperts (dequantized inside the kernel)."""
    sorted_ids, expert_ids, num_post = align
    args, fmt, (_, n, k) = weight_args(w)
    if a.shape[1] != k or a.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"grouped GEMM: activations {tuple(a.shape)} (inner stride {a.stride(1)}) do not match "
                         f"expert weights of {n} x {k} (N x K)")
    em = sorted_ids.numel()
    grid = (triton.cdiv(em, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    fused_moe_kernel[grid](
        a, args["b"], out, bias if bias is not None else a, topk_weights if topk_weights is not None else a,
        sorted_ids, expert_ids, num_post, args["scales"], args["zeros"], args["g_idx"], n, k, em, out.shape[0],
        a.stride(0), args["stride_be"], args["stride_bn"], args["stride_bk"], out.stride(0),
        bias.stride(0) if bias is not None else 0, args["stride_se"], args["stride_sn"], args["stride_sg"],
        args["stride_ze"], args["stride_zg"], args["stride_ge"], TOP_K=top_k,
        MUL_ROUTED_WEIGHT=topk_weights is not None, HAS_BIAS=bias is not None, IEEE_FP32=a.dtype == torch.float32,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **fmt)


def weights_kind(w, dtype: torch.dtype) -> str:
    """The tile table's name for a projection's weights: the activation dtype for float experts, else the
    packed format (int4/int8, fp8, mxfp4)."""
    if isinstance(w, torch.Tensor):
        return str(dtype).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")
    return f"int{w.bits}" if w.format == "int" else w.format  # gguf: one kind, whatever the block format


@functools.cache
def device_name(device: torch.device) -> str:
    """The tile table's device key (cached: no driver call per step). A device whose name cannot be read (fake
    CUDA tensors on a machine without a driver) has no tuned entry: the default tiles apply."""
    if device.type != "cuda":
        return "cpu"
    try:
        return torch.cuda.get_device_name(device)
    except (AssertionError, RuntimeError):
        return "unknown CUDA device"


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor | PackedExperts, w2: torch.Tensor | PackedExperts,
                     topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
                     tiles: MoETiles | None = None) -> torch.Tensor:
    """Same contract as kernels.moe_torch.fused_moe_torch: [T, H] -> [T, H]; packed experts (W4A16/W8A16 int,
    MXFP4) are dequantized tile by tile inside the grouped GEMMs."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter2 = w13.shape[0], w13.shape[1]
    if tiles is None:
        kind = weights_kind(w13, x.dtype)
        key = shape_key(kind, num_experts, x.shape[1], inter2 // 2, top_k)
        tiles = moe_tiles(device_name(x.device), key, num_tokens, top_k, num_experts, kind)
    x = x.contiguous()
    align = moe_align_block_size(topk_ids, tiles.block_m, num_experts)
    gate_up = torch.empty(num_tokens * top_k, inter2, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gate_up, w13_bias, None, align, top_k, tiles)
    hidden = moe_activation(gate_up, activation, alpha, limit)
    out = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(hidden, w2, out, w2_bias, topk_weights.reshape(-1).to(torch.float32).contiguous(), align, 1,
                 tiles)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
