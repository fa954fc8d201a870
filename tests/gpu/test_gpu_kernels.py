"""Triton paged attention against the torch reference on the real card (bf16, fp16, both FP8 caches, GQA,
sliding window, prefill chunks mixed with decodes; soft-capping and sinks at Gemma 2 / gpt-oss shapes), and an
engine serving from an FP8 KV cache."""
from __future__ import annotations

import pytest
import torch

from gpu_reference import greedy_tokens, hf_agreement
from hf_reference import MAX_TOKENS, make_prompts
from kernels import get_attention_backend
from kernels.paged_batch import make_paged_batch

pytestmark = pytest.mark.gpu
CASES = [  # (query lens, seq lens, kv heads, group, head_dim, sliding window)
    ([17, 1, 1, 5], [17, 41, 300, 25], 2, 4, 128, None),
    ([1] * 32, list(range(100, 3300, 100)), 8, 4, 128, None),  # decode-only: flash-decoding splits
    ([64, 1, 200], [64, 2000, 900], 4, 2, 64, 256),
    ([3, 1], [40, 513], 1, 8, 256, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{sum(c[0])}-d{c[4]}-w{c[5]}")
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                               (torch.bfloat16, torch.float8_e4m3fn),
                                               (torch.float16, torch.float8_e5m2)], ids=str)
def test_triton_matches_torch_attention(case, dtype, cache_dtype):
    query_lens, seq_lens, kv_heads, group, head_dim, window = case
    batch = make_paged_batch(query_lens, seq_lens, kv_heads, group, head_dim, dtype=dtype, cache_dtype=cache_dtype,
                             device="cuda")
    results = []
    for name in ("torch", "triton"):
        write, attend = get_attention_backend(name)
        k, v = batch.k_cache.clone(), batch.v_cache.clone()
        write(batch.new_key, batch.new_value, k, v, batch.slot_mapping, batch.k_scale, batch.v_scale)
        out = attend(batch.query, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc, head_dim ** -0.5,
                     window, batch.k_scale, batch.v_scale)
        results.append((k.view(torch.uint8), v.view(torch.uint8), out.float()))
    (k_ref, v_ref, out_ref), (k_tri, v_tri, out_tri) = results
    assert torch.equal(k_ref, k_tri) and torch.equal(v_ref, v_tri)  # same bytes written, NaN slots untouched
    err = float((out_ref - out_tri).abs().max())
    assert err <= 2e-2, f"max |triton - torch| = {err:.3e}"


VARIANT_CASES = [  # Gemma 2 shapes (d256, window 4096, caps 50) and gpt-oss shapes (64 heads / 8 KV, window 128)
    ([40, 1, 1], [40, 5000, 300], 4, 2, 256, 4096, dict(soft_cap=50.0), 256 ** -0.5),
    ([1] * 16 + [100], list(range(50, 850, 50)) + [700], 8, 8, 64, 128, dict(sinks=True), 0.125),
    ([1] * 8, list(range(1000, 9000, 1000)), 8, 8, 64, None, dict(sinks=True), 0.125),  # split decodes
]


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: f"{'-'.join(c[6])}-w{c[5]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_variants_match_torch_attention(case, dtype):
    query_lens, seq_lens, kv_heads, group, head_dim, window, variants, scale = case
    batch = make_paged_batch(query_lens, seq_lens, kv_heads, group, head_dim, dtype=dtype, device="cuda")
    variants = dict(variants)
    if variants.get("sinks"):
        variants["sinks"] = torch.randn(kv_heads * group, device="cuda") * 2
    results = []
    for name in ("torch", "triton"):
        write, attend = get_attention_backend(name)
        k, v = batch.k_cache.clone(), batch.v_cache.clone()
        write(batch.new_key, batch.new_value, k, v, batch.slot_mapping)
        results.append(attend(batch.query, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc, scale,
                              window, **variants).float())
    err = float((results[0] - results[1]).abs().max())
    assert err <= 2e-2, f"max |triton - torch| = {err:.3e}"


def test_fp8_kv_cache_engine_stays_close_to_hf(tiny_model_dir, make_llm):
    path = tiny_model_dir("llama")
    prompts = make_prompts(400)
    llm = make_llm(path, dtype="bfloat16", kv_cache_dtype="fp8", num_gpu_blocks_override=256)
    assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    outputs = greedy_tokens(llm, prompts, MAX_TOKENS)
    agreement, first = hf_agreement(path, prompts, outputs, torch.bfloat16)
    print(f"fp8 KV: {agreement:.2%} of tokens identical to HF's bf16 argmax; first divergence: {first}")
    assert agreement >= 0.95, f"{agreement:.2%}; first divergence: {first}"
