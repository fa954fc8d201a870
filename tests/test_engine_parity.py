"""Greedy token ids identical to HF transformers `generate` on each supported architecture."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tiny_models import ARCHS, hf_model

PROMPT_LENS = [1, 3, 15, 16, 17, 40, 120, 230]
MAX_TOKENS = [64, 8, 33, 20, 64, 16, 40, 12]


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in PROMPT_LENS]


def hf_greedy(path, prompts, max_tokens) -> list[list[int]]:
    model = hf_model(path)
    outs = []
    for prompt, n in zip(prompts, max_tokens):
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        outs.append(ids[0, len(prompt):].tolist())
    return outs


def engine_greedy(path, prompts, max_tokens, **engine_kwargs) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", **engine_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model_dir(arch)
            prompts = make_prompts(400)
            cache[arch] = (path, prompts, hf_greedy(path, prompts, MAX_TOKENS))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_hf(reference, arch):
    path, prompts, expected = reference(arch)
    assert engine_greedy(path, prompts, MAX_TOKENS) == expected


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_matches_hf_with_tiny_pool(reference, arch):
    """A pool of 24 blocks holds ~2 long requests at a time: the rest wait (or are preempted) for blocks."""
    path, prompts, expected = reference(arch)
    assert engine_greedy(path, prompts, MAX_TOKENS, num_gpu_blocks_override=24, max_num_seqs=4) == expected


def test_sharded_checkpoint_loads_identically(tiny_model_dir, reference):
    path, prompts, expected = reference("llama")
    sharded = tiny_model_dir("llama", shards=3)
    assert any(p.name.endswith(".index.json") for p in sharded.iterdir())
    assert engine_greedy(sharded, prompts[:3], MAX_TOKENS[:3]) == expected[:3]
