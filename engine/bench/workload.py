"""Benchmark inputs: a ShareGPT-like request mix and a random-weight Llama folder made on the fly.

Prompt lengths are log-normal with mean ~160 tokens, output lengths log-normal with mean ~300, both
clipped to max_model_len, prompts are random token ids, and every request generates exactly its drawn
length (ignore_eos), so every engine does the same work. Fixed seed: identical across runs.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

BENCH_LLAMA = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=1536, vocab_size=8192, max_position_embeddings=2048)


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


def make_random_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Write a random-weight LlamaForCausalLM folder (bf16-free float32 weights) with a word-level tokenizer."""
    return make_random_model(path, "LlamaConfig", "LlamaForCausalLM", {**BENCH_LLAMA, **overrides}, seed)


def make_random_model(path: Path, config_name: str, model_name: str, shape: dict, seed: int = 0) -> Path:
    """Write a random-weight folder of any transformers architecture, float32, with a word-level tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = getattr(transformers, config_name)(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                                dtype="float32")
    config.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3} | {f"w{i}": i for i in range(4, shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    return path
