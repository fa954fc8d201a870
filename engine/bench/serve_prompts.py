"""Benchmark prompts built to token counts with the served model's own tokenizer, over HTTP (torch-free).

A client without the model's tokenizer (the app's Benchmark tab, `pagedesk-bench serve --tokenizer served`)
cannot count tokens, and text sized by words can be twice as long as asked and run past the context. So the
server counts: a stretch of English words is tokenized once (POST /tokenize), each request's prompt is a
window of those token ids of the drawn length (a different window per request, so prompts share no prefix
to cache), turned back into text (POST /detokenize) and counted as the route will count it (the completions
prompt with its special tokens, or the chat message with its template); a prompt that counts more than its
room is trimmed and counted again. Lengths are drawn as `synthetic_requests` draws them, each capped by the
model's context (the max_model_len /tokenize answers) less the reply, so no request is one the server must
refuse. Through the router, `model` names the model whose tokenizer counts.
"""
from __future__ import annotations

import random
from typing import Callable

import httpx

from engine.bench.serve_dataset import ServeRequest, synthetic_requests, words_prompt

MAX_TRIMS = 4  # re-tokenizing a window rarely differs by more than a token or two: a few trims settle it
WINDOW_SHIFT = 17  # tokens between the starts of successive prompts' windows


class ServedTokenizer:
    """The endpoint's /tokenize and /detokenize (vLLM's shapes), with the endpoint's key."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.client = httpx.Client(timeout=timeout_s,
                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    def close(self) -> None:
        self.client.close()

    def _post(self, path: str, body: dict) -> dict:
        if self.model:
            body = {"model": self.model, **body}
        response = self.client.post(self.base_url + path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{path} answered HTTP {response.status_code}: {error_message(response)}")
        return response.json()

    def encode(self, text: str) -> tuple[list[int], int]:
        """(token ids without special tokens, the model's max_model_len)."""
        answer = self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
        return list(answer["tokens"]), int(answer["max_model_len"])

    def decode(self, ids: list[int]) -> str:
        return str(self._post("/detokenize", {"tokens": ids})["prompt"])

    def count(self, text: str, endpoint: str) -> int:
        """Prompt tokens of `text` as the route counts them: the chat template's, or the prompt's special tokens."""
        if endpoint == "chat":
            body = {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
        else:
            body = {"prompt": text}
        return int(self._post("/tokenize", body)["count"])


def error_message(response: httpx.Response) -> str:
    """The server's own sentence from an OpenAI-shaped error body, else the start of the body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or f"HTTP {response.status_code}"


def served_requests(tokenizer: ServedTokenizer, num_prompts: int, endpoint: str = "completions", seed: int = 0,
                    prompt_mean: float = 160, output_mean: float = 300, long_fraction: float = 0.0,
                    long_range: tuple[int, int] = (1024, 2048), fixed_output_len: int | None = None,
                    on_progress: Callable[[int, int], None] | None = None) -> list[ServeRequest]:
    """`num_prompts` text prompts whose `prompt_len` is the server's count, each fitting the model's context with
    its reply; a long-prompt range past the context is narrowed to it. `on_progress(done, total)` after each."""
    _, max_model_len = tokenizer.encode("hello")
    overhead = tokenizer.count("", endpoint)  # the template's (or the special tokens') own share
    room = max_model_len - overhead
    if room < 2:
        raise ValueError(f"the model's context ({max_model_len} tokens) leaves no room for a prompt and a reply")
    low, high = long_range
    long_range = (max(1, min(low, room // 2)), max(1, min(high, room - 1)))
    drawn = synthetic_requests(num_prompts, 1000, room, seed, prompt_mean, output_mean, long_fraction,
                               long_range, fixed_output_len)
    pool = _token_pool(tokenizer, max(len(r.prompt) for r in drawn) + WINDOW_SHIFT * min(num_prompts, 512), seed)
    out = []
    for i, r in enumerate(drawn):
        output_len = max(1, min(r.output_len, room - 1))
        target = max(1, min(len(r.prompt), room - output_len))
        start = (i * WINDOW_SHIFT) % max(1, len(pool) - target)
        out.append(_fitted(tokenizer, pool[start: start + target], endpoint, overhead + target, output_len))
        if on_progress is not None:
            on_progress(i + 1, num_prompts)
    return out


def _token_pool(tokenizer: ServedTokenizer, num_tokens: int, seed: int) -> list[int]:
    """At least `num_tokens` ids of plain English words in the served tokenizer (one word is one token or more)."""
    rng = random.Random(seed + 2)
    ids, _ = tokenizer.encode(words_prompt([rng.randrange(1000) for _ in range(num_tokens)]))
    if not ids:
        raise ValueError("the served tokenizer turned the benchmark's words into no tokens")
    while len(ids) < num_tokens:  # a tokenizer that merges words: repeat the stretch
        ids = ids + ids
    return ids


def _fitted(tokenizer: ServedTokenizer, window: list[int], endpoint: str, limit: int, output_len: int) -> ServeRequest:
    """The window's text, trimmed until the route's count is at most `limit` tokens."""
    for _ in range(MAX_TRIMS):
        text = tokenizer.decode(window)
        count = tokenizer.count(text, endpoint)
        if count <= limit or len(window) <= 1:
            return ServeRequest(text, count, output_len)
        window = window[: max(1, len(window) - (count - limit))]
    raise ValueError(f"a prompt of {len(window)} tokens counts {count} after {MAX_TRIMS} trims; the served "
                     "tokenizer does not round-trip its own text")
