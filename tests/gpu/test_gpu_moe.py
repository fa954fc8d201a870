"""The fused-MoE Triton kernel on a card: bf16/fp16 and packed experts (W4A16 g128 with and without GPTQ act
order, FP8 with 128 x 128 blocks, MXFP4) against the torch loop, and decode-bandwidth figures.

Qwen3-30B-A3B's expert shape (128 experts, top-8, hidden 2048, expert size 768). Prints GB/s of expert weights
read per decode step at batch 1/8/32 and prefill TFLOP/s at 2048 tokens: the figures BENCHMARKS.md owes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.bench_timing import median_ms
from kernels.moe_torch import PackedExperts, fused_moe_torch
from kernels.quant_torch import pack_int32
from kernels.triton_moe import fused_moe_triton

pytestmark = pytest.mark.gpu
E, K, H, I = 128, 8, 2048, 768


def weights(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=gen, dtype=dtype) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", generator=gen, dtype=dtype) * 0.02
    return w13, w2


def routing(tokens):
    logits = torch.randn(tokens, E, device="cuda")
    weights, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_fused_moe_matches_torch_on_the_card(dtype, tokens):
    w13, w2 = weights(dtype)
    x = torch.randn(tokens, H, device="cuda", dtype=dtype)
    topk_weights, topk_ids = routing(tokens)
    expected = fused_moe_torch(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    got = fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_fused_moe_decode_bandwidth_and_prefill_flops():
    w13, w2 = weights(torch.bfloat16)
    for tokens in (1, 8, 32, 2048):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        topk_weights, topk_ids = routing(tokens)
        seconds = median_ms(lambda _i: fused_moe_triton(x, w13, w2, topk_weights, topk_ids), 1, x.device,
                            iters=20) / 1e3
        experts = topk_ids.unique().numel()
        read = experts * 3 * H * I * 2
        flops = 2 * tokens * K * 3 * H * I
        print(f"fused MoE bf16, {tokens} tokens: {seconds * 1e3:.3f} ms, {experts} experts read, "
              f"{read / seconds / 1e9:.0f} GB/s of expert weights, {flops / seconds / 1e12:.1f} TFLOP/s")


def packed(fmt: str, n: int, k: int) -> PackedExperts:
    """Random Qwen3-30B-A3B-shaped experts as the loader keeps them (W4A16 g128: float16 scales, byte zeros;
    "act": the same with GPTQ act order's per-expert g_idx; FP8: e4m3 with 128 x 128 block scales, per row)."""
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    if fmt == "fp8":
        weight = (torch.randn(E, n, k, device="cuda", generator=gen) * 100).clamp(-448, 448)
        scales = torch.rand(E, n, k // 128, device="cuda", generator=gen) * 1e-4 + 1e-5
        return PackedExperts("fp8", weight.to(torch.float8_e4m3fn), scales, bits=8, group_size=128)
    if fmt == "mxfp4":
        blocks = torch.randint(0, 256, (E, n, k // 2), device="cuda", generator=gen, dtype=torch.int32)
        scales = torch.randint(118, 124, (E, n, k // 32), device="cuda", generator=gen, dtype=torch.int32)
        return PackedExperts("mxfp4", blocks.to(torch.uint8), scales.to(torch.uint8))
    codes = torch.randint(0, 16, (E, k, n), device="cuda", generator=gen, dtype=torch.int32)
    words = torch.stack([pack_int32(codes[e], 4, dim=0) for e in range(E)])
    zeros = torch.randint(0, 16, (E, k // 128, n), device="cuda", generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(E, k // 128, n, device="cuda", generator=gen) * 0.004 + 0.001).half()
    g_idx = None
    if fmt == "act":
        g_idx = torch.stack([torch.randperm(k, device="cuda", generator=gen) // 128 for _ in range(E)]).int()
    return PackedExperts("int", words, scales, zeros, 4, 128, g_idx=g_idx)


@pytest.mark.parametrize("fmt", ["int", "act", "fp8", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_packed_experts_match_torch_on_the_card(fmt, tokens):
    w13, w2 = packed(fmt, 2 * I, H), packed(fmt, H, I)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = routing(tokens)
    reference = [dataclasses.replace(w, dtype=torch.float32) for w in (w13, w2)]
    expected = fused_moe_torch(x.float(), *reference, topk_weights, topk_ids)
    got = fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.parametrize("fmt", ["int", "act", "fp8", "mxfp4"])
def test_packed_experts_decode_bandwidth(fmt):
    w13, w2 = packed(fmt, 2 * I, H), packed(fmt, H, I)
    bits = {"int": 4 + (16 + 8) / 128, "act": 4 + (16 + 8) / 128,  # g_idx: 4 bytes per input row, negligible
            "fp8": 8 + 32 / 128,
            "mxfp4": 4 + 8 / 32}[fmt]
    for tokens in (1, 8, 32):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        topk_weights, topk_ids = routing(tokens)
        seconds = median_ms(lambda _i: fused_moe_triton(x, w13, w2, topk_weights, topk_ids), 1, x.device,
                            iters=20) / 1e3
        experts = topk_ids.unique().numel()
        read = experts * 3 * H * I * bits / 8
        print(f"fused MoE {fmt} experts, {tokens} tokens: {seconds * 1e3:.3f} ms, {experts} experts read, "
              f"{read / seconds / 1e9:.0f} GB/s of packed expert weights")
