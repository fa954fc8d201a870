"""Requests for `pagedesk-bench serve`: ShareGPT-like synthetic lengths (optionally with a share of long
prompts) or a JSONL file of prompts. Torch-free (the GUI's Benchmark tab imports it).

A synthetic prompt is a list of random token ids drawn by `engine.bench.workload.sharegpt_like`; with a
tokenizer it is decoded to text (so chat endpoints can take it), without one it travels as token ids
(completions only), which every vLLM-compatible server accepts and which keeps prompt lengths exact;
`tokenizer="words"` maps the ids to common English words instead (text of about the same length, for an
endpoint whose tokenizer is unknown, as in the app's Benchmark tab).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from engine.bench.workload import sharegpt_like


@dataclass(frozen=True, slots=True)
class ServeRequest:
    prompt: str | list[int]  # text, or token ids for the completions route
    prompt_len: int  # tokens (exact for ids and tokenized text; estimated by words for untokenized JSONL)
    output_len: int  # max_tokens asked for


def synthetic_requests(num_prompts: int, vocab_size: int, max_model_len: int = 2048, seed: int = 0,
                       prompt_mean: float = 160, output_mean: float = 300, long_fraction: float = 0.0,
                       long_range: tuple[int, int] = (1024, 2048), fixed_output_len: int | None = None,
                       tokenizer=None) -> list[ServeRequest]:
    """ShareGPT-like lengths; a `long_fraction` of the requests (chosen by the seed) gets a prompt of
    uniformly `long_range` tokens instead, to model long documents arriving among chat turns."""
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long prompt fraction must be within [0, 1], got {long_fraction}")
    low, high = long_range
    if long_fraction and not 1 <= low <= high < max_model_len:
        raise ValueError(f"long prompt range {low}:{high} must lie within 1..max_model_len-1 ({max_model_len - 1})")
    drawn = sharegpt_like(num_prompts, vocab_size, max_model_len, seed, prompt_mean, output_mean)
    rng = random.Random(seed + 1)
    out = []
    for r in drawn:
        ids, output_len = r.prompt_token_ids, fixed_output_len or r.output_len
        if rng.random() < long_fraction:
            ids = [rng.randrange(10, vocab_size) for _ in range(rng.randint(low, high))]
        output_len = max(1, min(output_len, max_model_len - len(ids)))
        out.append(_with_tokenizer(ids, output_len, tokenizer))
    return out


# Common English words, one token each in the usual BPE vocabularies: text prompts of about the drawn
# length for endpoints whose tokenizer we do not have (the server's usage chunk reports the exact count).
WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which do their "
         "time if will way about many then them write would like so these her long make thing see him two has look "
         "more day could go come did number sound no most people my over know water than call first who may down "
         "side been now find any new work part take get place made live where after back little only round man "
         "year came show every good me give our under name very through just form sentence great think say "
         "help").split()


def words_prompt(ids: list[int]) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


def _with_tokenizer(ids: list[int], output_len: int, tokenizer) -> ServeRequest:
    if tokenizer == "words":
        return ServeRequest(words_prompt(ids), len(ids), output_len)
    if tokenizer is None:
        return ServeRequest(ids, len(ids), output_len)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return ServeRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), output_len)


def jsonl_requests(path: Path, num_prompts: int | None = None, default_output_len: int = 128,
                   tokenizer=None) -> list[ServeRequest]:
    """One JSON object per line with "prompt" (text) and optionally "output_len" (or "max_tokens", or
    "output_tokens" as in `vllm bench serve --dataset-name custom` files)."""
    out = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            output_len = int(row.get("output_len", row.get("max_tokens", row.get("output_tokens",
                                                                                    default_output_len))))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{line_no}: expected a JSON object with a \"prompt\" string and an "
                             f"optional integer \"output_len\" ({exc})") from None
        if not isinstance(prompt, str) or not prompt or output_len < 1:
            raise ValueError(f"{path}:{line_no}: \"prompt\" must be a non-empty string and output_len >= 1")
        length = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer else len(prompt.split())
        out.append(ServeRequest(prompt, length, output_len))
        if num_prompts is not None and len(out) == num_prompts:
            break
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def write_jsonl(path: Path, requests: list[ServeRequest]) -> None:
    """Save requests so another client can replay the same load: "prompt", "output_len", and "output_tokens"
    (the key `vllm bench serve --dataset-name custom` reads)."""
    if any(not isinstance(r.prompt, str) for r in requests):
        raise ValueError("--save-dataset needs text prompts: give --tokenizer")
    Path(path).write_text("".join(json.dumps({"prompt": r.prompt, "output_len": r.output_len,
                                              "output_tokens": r.output_len}) + "\n" for r in requests))
