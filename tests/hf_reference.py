"""The correctness oracle: greedy continuations from HF transformers, and the same prompts through our engine."""
from __future__ import annotations

import random

import torch

from engine import LLM, SamplingParams
from tiny_models import hf_model

PROMPT_LENS = [1, 3, 15, 16, 17, 40, 120, 230]
MAX_TOKENS = [64, 8, 33, 20, 64, 16, 40, 12]


HYBRID_PICKS, HYBRID_MAX_TOKENS = [1, 3, 4, 6], [10, 12, 6, 8]  # conftest.hybrid_reference: prompts of 3, 16, 17, 120 tokens


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
