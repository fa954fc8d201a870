"""Engine logprobs (per token: {token_id: Logprob}) in OpenAI's chat and completions shapes.

JSON has no -inf, so a logprob below -9999 is sent as -9999.0, as vLLM does. With vLLM's
`return_tokens_as_token_ids` every token is spelled "token_id:N" (`token_names`), so tokens that are not
text on their own (a piece of a UTF-8 character) stay unambiguous.
"""
from __future__ import annotations

import math
from typing import Any

from engine.core.outputs import Logprob
from engine.entrypoints.openai.responses import CompletionLogprobs, TokenLogprob, TopLogprob

FLOOR = -9999.0


def _finite(value: float) -> float:
    return FLOOR if math.isnan(value) or value < FLOOR else float(value)


class TokenIdNames:
    """Stands in for the tokenizer when tokens are to be named by id."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"token_id:{i}" for i in ids)


def token_names(req: Any, tokenizer: Any) -> Any:
    """What spells the request's logprob tokens: the tokenizer, or ids when it set return_tokens_as_token_ids."""
    return TokenIdNames() if getattr(req, "return_tokens_as_token_ids", None) else tokenizer


def _token_text(token_id: int, lp: Logprob, tokenizer: Any) -> str:
    if isinstance(tokenizer, TokenIdNames):
        return tokenizer.decode([token_id])
    if lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [(tid, lp) for tid, lp in ranked if lp.rank <= k][:k]


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], k: int,
                  tokenizer: Any) -> list[TokenLogprob]:
    """One TokenLogprob per generated token, each with its top-k alternatives."""
    out = []
    for tid, entry in zip(token_ids, logprobs):
        chosen = entry.get(tid)
        text = _token_text(tid, chosen, tokenizer) if chosen else tokenizer.decode([tid])
        tops = []
        for alt_id, alt in _top(entry, k):
            alt_text = _token_text(alt_id, alt, tokenizer)
            tops.append(TopLogprob(token=alt_text, logprob=_finite(alt.logprob), bytes=list(alt_text.encode())))
        out.append(TokenLogprob(token=text, logprob=_finite(chosen.logprob if chosen else -math.inf),
                                bytes=list(text.encode()), top_logprobs=tops))
    return out


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None], k: int, tokenizer: Any,
                        start_offset: int, result: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Completions' parallel lists (appended to `result` if given); text_offset counts characters from
    `start_offset`. A None entry (the first prompt token under echo) gets null logprobs, as OpenAI sends."""
    result = result or CompletionLogprobs()
    offset = start_offset
    for tid, entry in zip(token_ids, logprobs):
        if entry is None:
            text = tokenizer.decode([tid])
            result.tokens.append(text)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(offset)
            offset += len(text)
            continue
        chosen = entry.get(tid)
        text = _token_text(tid, chosen, tokenizer) if chosen else tokenizer.decode([tid])
        top = {_token_text(alt_id, alt, tokenizer): _finite(alt.logprob) for alt_id, alt in _top(entry, k)}
        top.setdefault(text, _finite(chosen.logprob) if chosen else FLOOR)
        result.tokens.append(text)
        result.token_logprobs.append(_finite(chosen.logprob) if chosen else FLOOR)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None], tokenizer: Any) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None or {token id: {logprob, rank, decoded_token}}."""
    return [None if e is None else {tid: {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                          "decoded_token": _token_text(tid, lp, tokenizer)} for tid, lp in e.items()}
            for e in entries]
