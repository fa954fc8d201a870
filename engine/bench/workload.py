"""The benchmark request mix: ShareGPT-like prompt and output lengths, random token ids.

Prompt lengths are log-normal with mean ~160 tokens, output lengths log-normal with mean ~300, both
clipped to max_model_len, prompts are random token ids, and every request generates exactly its drawn
length (ignore_eos), so every engine does the same work. Fixed seed: identical across runs. Torch-free (the
GUI's Benchmark tab draws its synthetic prompts here); the random-weight model is engine/bench/random_model.py.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def sharegpt_like(num_prompts: int, vocab_size: int, max_model_len: int = 2048, seed: int = 0,
                  prompt_mean: float = 160, output_mean: float = 300, sigma: float = 0.8) -> list[BenchRequest]:
    rng = random.Random(seed)

    def draw(mean: float, low: int, high: int) -> int:
        mu = math.log(mean) - sigma ** 2 / 2  # log-normal with this mean
        return max(low, min(high, round(rng.lognormvariate(mu, sigma))))

    out = []
    for _ in range(num_prompts):
        prompt_len = draw(prompt_mean, 4, max_model_len // 2)
        output_len = draw(output_mean, 4, max_model_len - prompt_len)
        out.append(BenchRequest([rng.randrange(10, vocab_size) for _ in range(prompt_len)], output_len))
    return out
