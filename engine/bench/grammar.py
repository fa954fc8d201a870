"""`pagedesk-bench grammar`: cost of the structured-output grammar engines at several vocabulary sizes.

For each vocabulary (synthetic byte-level BPE tokenizers of 400 / 32k / 128k tokens, since no real one
can be downloaded here) and each engine importable (xgrammar, which the engine uses; llguidance if
installed, for comparison), it times: reading the tokenizer, compiling a typical nested JSON schema,
and filling one token bitmask per step while a random walk through the grammar accepts allowed tokens.
Prints a Markdown table for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city"]},
    "role": {"enum": ["admin", "user", "guest"]}, "score": {"type": "number"}},
    "required": ["name", "age", "role"]}


def synthetic_tokenizer(size: int, seed: int = 0):
    """A byte-level BPE tokenizer of `size` tokens whose merges join random earlier tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokens, merges = list(vocab), []
    while len(vocab) < size - 2:
        a, b = rng.choice(tokens[:max(300, len(tokens) // 2)]), rng.choice(tokens[:300])
        if a + b in vocab or len(a + b) > 16:
            continue
        vocab[a + b] = len(vocab)
        tokens.append(a + b)
        merges.append((a, b))
    vocab["</s>"], vocab["<s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>")


def _walk(fill, accept, reset, is_done, bitmask: torch.Tensor, vocab: int, steps: int) -> float:
    """Mean seconds per bitmask fill over a random walk of `steps` accepted tokens."""
    rng, total = random.Random(0), 0.0
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(steps):
        start = time.perf_counter()
        fill()
        total += time.perf_counter() - start
        allowed = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:vocab].nonzero().flatten().tolist()
        if not allowed or is_done():
            reset()
            continue
        accept(rng.choice(allowed))
    return total / steps


def bench_xgrammar(tokenizer, steps: int) -> tuple[float, float, float]:
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    fill = _walk(lambda: matcher.fill_next_token_bitmask(bitmask, 0), matcher.accept_token, matcher.reset,
                 matcher.is_terminated, bitmask, info.vocab_size, steps)
    return t1 - t0, t2 - t1, fill


def bench_llguidance(tokenizer, steps: int) -> tuple[float, float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    t1 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    t2 = time.perf_counter()
    bitmask = lt.allocate_token_bitmask(1, lltok.vocab_size)
    fill = _walk(lambda: lt.fill_next_token_bitmask(matcher, bitmask, 0), matcher.consume_token, matcher.reset,
                 matcher.is_stopped, bitmask, lltok.vocab_size, steps)
    return t1 - t0, t2 - t1, fill


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench grammar", description=__doc__)
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[400, 32000, 128000])
    parser.add_argument("--steps", type=int, default=200, help="bitmask fills timed per engine and vocabulary")
    args = parser.parse_args(argv)
    engines = {"xgrammar": bench_xgrammar}
    if importlib.util.find_spec("llguidance") is not None:
        engines["llguidance"] = bench_llguidance
    print("| vocab | engine | read tokenizer (ms) | compile schema (ms) | bitmask fill per token (µs) |")
    print("|---:|---|---:|---:|---:|")
    for size in args.vocab_sizes:
        tokenizer = synthetic_tokenizer(size)
        for name, bench in engines.items():
            setup, compile_s, fill = bench(tokenizer, args.steps)
            print(f"| {size} | {name} | {setup * 1e3:.0f} | {compile_s * 1e3:.1f} | {fill * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
