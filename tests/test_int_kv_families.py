"""Integer KV caches end to end for every family (full and window layers, hybrids' attention layers): teacher-forced
log-probs of a prompt's own tokens, int8 and int4 caches against the fp32 one, on the torch path (the numba decode and
the torch prefill read the same values and scales).

As tests/test_fp8_kv_families.py does for FP8: one 70-token prompt (past every tiny model's sliding window) scored with
prompt_logprobs. The bounds are what the formats' rounding gives in these models, with room. int8 (one scale per token
and head, half a step of max|x|/127): mean |Δ| <= 0.01 nats and worst <= 0.06 (measured: mean <= 0.006, max <= 0.031,
Gemma 2's ten-times-larger weights and soft caps the largest; about five times below FP8 e4m3). int4 (one scale per 16
values here, the tiny models' whole head; half a step of max|x|/7): mean <= 0.15 and worst <= 0.6 (measured: mean
0.002-0.094, max 0.015-0.39, Gemma 2 again the largest; about three times FP8's error).
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

FAMILIES = ["llama", "phi3", "gemma2", "gemma3", "gemma4", "gpt_oss", "qwen3_moe", "glm4_moe", "qwen3_5"]
BOUNDS = {"int8": (0.01, 0.06), "int4": (0.15, 0.6)}  # (mean, max) |Δ logprob| in nats
_rng = random.Random(0)
PROMPT = [_rng.randrange(5, 400) for _ in range(70)]


def prompt_token_logprobs(path, kv_cache_dtype: str) -> list[float]:
    llm = LLM(str(path), device="cpu", kv_cache_dtype=kv_cache_dtype, max_model_len=96, block_size=8)
    cache = llm.engine.runner.kv_cache
    assert cache.dtype == {"auto": torch.float32, "int8": torch.int8, "int4": torch.uint8}[kv_cache_dtype]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], PROMPT[1:])]


@pytest.mark.parametrize("arch", FAMILIES)
def test_integer_kv_cache_tracks_full_precision(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    full = prompt_token_logprobs(path, "auto")
    for name, (mean_bound, max_bound) in BOUNDS.items():
        diffs = [abs(a - b) for a, b in zip(full, prompt_token_logprobs(path, name))]
        mean = sum(diffs) / len(diffs)
        print(f"{arch}: {name} KV vs fp32 KV, |Δ logprob| mean {mean:.4f} max {max(diffs):.4f} over {len(diffs)} tokens")
        assert len(diffs) == len(PROMPT) - 1
        assert 0 < max(diffs) <= max_bound and mean <= mean_bound  # > 0: the integer cache is really the one read


def test_integer_kv_pages_hold_values_and_scales(tiny_model_dir):
    """The pool's bytes per block are the layout's (values and scales), and a copy-on-write block copies both."""
    from engine.kv.block_pool import kv_pages
    from engine.kv.kv_cache_interface import model_kv_layout
    from engine.platform.devices import kv_storage
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", kv_cache_dtype="int4", num_gpu_blocks_override=12)
    runner = llm.engine.runner
    layout = model_kv_layout(llm.engine.model_config, 16, kv_storage(torch.uint8))
    assert runner.kv_cache_bytes() == kv_pages(12) * layout.bytes_per_block  # the pool's 12 and the null page
    assert runner.pools.kv_scales.shape == (2, 2, 13, 16, 2)  # two layers, K and V, 13 pages, 16 tokens, 32/16
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # a partial block the two outputs share until each writes its copy
    alone = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    both = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert [c.token_ids for c in both.outputs] == [alone.outputs[0].token_ids] * 2  # scales copied with the values
