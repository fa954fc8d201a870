"""FP8 KV cache end to end on the torch path: teacher-forced top-1 agreement and logprobs vs the fp32 cache."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.attention_torch import dequantize, quantize_fp8


@pytest.mark.parametrize("dtype,rel", [(torch.float8_e4m3fn, 2 ** -4), (torch.float8_e5m2, 2 ** -3)])
def test_fp8_round_trip_error_bound(dtype, rel):
    x = torch.randn(4096) * 10
    x = x[x.abs() > 2 ** -6]  # the normal range of both formats (subnormals have absolute, not relative, error)
    back = dequantize(quantize_fp8(x, 1.0, dtype), 1.0, torch.float32)
    assert ((back - x).abs() / x.abs()).max() <= rel  # half an ulp: 2^-(mantissa bits + 1)


def next_token_logprobs(llm: LLM, contexts: list[list[int]]) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    return [o.outputs[0].logprobs[0] for o in llm.generate(contexts, params, use_tqdm=False)]


@pytest.mark.parametrize("kv_cache_dtype,min_agreement,max_logprob_diff", [("fp8", 0.95, 0.05),
                                                                            ("fp8_e5m2", 0.95, 0.05)])
def test_fp8_kv_cache_tracks_full_precision(tiny_model_dir, kv_cache_dtype, min_agreement, max_logprob_diff):
    path = tiny_model_dir("qwen2")
    rng = random.Random(0)
    base = LLM(str(path), device="cpu")
    prompts = [[rng.randrange(5, 400) for _ in range(n)] for n in (5, 30, 70, 120)]
    greedy = base.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    contexts = [p + o.outputs[0].token_ids[:i] for p, o in zip(prompts, greedy) for i in range(24)]
    want = next_token_logprobs(base, contexts)
    fp8 = LLM(str(path), device="cpu", kv_cache_dtype=kv_cache_dtype)
    assert fp8.engine.runner.kv_cache.element_size() == 1
    got = next_token_logprobs(fp8, contexts)
    top = lambda d: max(d.items(), key=lambda kv: kv[1].logprob)[0]  # noqa: E731
    agreement = sum(top(a) == top(b) for a, b in zip(want, got)) / len(want)
    diffs = [abs(a[t].logprob - b[t].logprob) for a, b in zip(want, got) for t in a if t in b]
    print(f"{kv_cache_dtype}: top-1 agreement {agreement:.1%}, max |Δlogprob| {max(diffs):.4f}")
    assert agreement >= min_agreement
    assert max(diffs) <= max_logprob_diff
