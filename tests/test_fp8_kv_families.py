"""FP8 KV cache end to end for every family: teacher-forced logprobs of a prompt's own tokens, FP8 cache vs the
full-precision one, on the torch path.

One 70-token prompt (past every tiny model's sliding window, so window groups have freed blocks) scored with
prompt_logprobs: at each position the logprob of the prompt's next token, a random vocabulary entry, so the
comparison samples the whole distribution rather than its (nearly tied, in a random tiny model) top. The bound
is what FP8 e4m3's 2^-4 relative rounding of K and V gives in these models, with room: the mean |Δ| over 69
positions stays below 0.06 nats and the worst below 0.25 (measured: mean ~0.002 and max < 0.02 for most
families; Gemma 2's ten-times-larger weights and soft caps give the largest, mean 0.04 and max 0.15).
"""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

FAMILIES = ["llama", "phi3", "gemma2", "gemma3", "gemma4", "gpt_oss", "qwen3_moe", "mixtral", "glm4_moe"]
_rng = random.Random(0)
PROMPT = [_rng.randrange(5, 400) for _ in range(70)]


def prompt_token_logprobs(path, kv_cache_dtype: str) -> list[float]:
    llm = LLM(str(path), device="cpu", kv_cache_dtype=kv_cache_dtype, max_model_len=96, block_size=8)
    assert llm.engine.runner.kv_cache.element_size() == (1 if kv_cache_dtype == "fp8" else 4)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], PROMPT[1:])]


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp8_kv_cache_tracks_full_precision(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    full, fp8 = prompt_token_logprobs(path, "auto"), prompt_token_logprobs(path, "fp8")
    diffs = [abs(a - b) for a, b in zip(full, fp8)]
    mean = sum(diffs) / len(diffs)
    print(f"{arch}: FP8 KV vs fp32 KV, |Δ logprob| mean {mean:.4f} max {max(diffs):.4f} over {len(diffs)} tokens")
    assert len(diffs) == len(PROMPT) - 1
    assert 0 < max(diffs) <= 0.25 and mean <= 0.06  # > 0: the FP8 cache is really the one read
