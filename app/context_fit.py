"""Fit a chat request into the model's context before it is sent, so a long chat never hits the context wall.

The prompt is counted by the server itself (POST /tokenize with the chat messages, which also answers the
model's max_model_len), because only the server's tokenizer and chat template know the real count. When
the reply's Max tokens does not fit beside the prompt it is lowered to what is left; when even a short
reply (MIN_REPLY_TOKENS) would not fit, the oldest turns are dropped — never the system prompt, never the
new message — until one does. `Fit.note()` says in words what was changed, for the chat to show. A count
that cannot be had (an older server, a router without /tokenize) sends the request unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MIN_REPLY_TOKENS = 32  # below this room a reply is hardly one sentence: drop old turns instead

Counter = Callable[[list[dict]], "tuple[int, int] | None"]  # messages -> (prompt tokens, max_model_len)


class ContextFull(ValueError):
    """Even the new message alone (with the system prompt) leaves no room for a reply; phrased for the user."""


@dataclass
class Fit:
    messages: list[dict]
    max_tokens: int
    asked_max_tokens: int
    dropped: int = 0  # oldest messages left out (the system prompt never is)
    prompt_tokens: int = 0
    max_model_len: int = 0

    def note(self) -> str:
        """What was changed to fit, in words ("" when nothing was)."""
        parts = []
        if self.dropped:
            parts.append(f"Left out the {self.dropped} oldest message{'s' if self.dropped != 1 else ''} of this chat "
                         f"so it fits the model's {self.max_model_len:,}-token context (the system prompt is kept). "
                         "Press New chat to start afresh.")
        if self.max_tokens < self.asked_max_tokens:
            parts.append(f"Max tokens lowered from {self.asked_max_tokens:,} to {self.max_tokens:,} for this reply: "
                         f"the prompt uses {self.prompt_tokens:,} of {self.max_model_len:,} tokens.")
        return " ".join(parts)


def fit_to_context(messages: list[dict], max_tokens: int, count: Counter,
                   min_reply: int = MIN_REPLY_TOKENS) -> Fit:
    """The messages and max_tokens to send. Counts once per dropped turn, so at most len(messages) + 1 times."""
    system = messages[:1] if messages and messages[0].get("role") == "system" else []
    turns = list(messages[len(system):])
    dropped = 0
    while True:
        counted = count(system + turns)
        if counted is None:  # no count to be had: send as asked
            return Fit(list(messages), max_tokens, max_tokens)
        prompt_tokens, max_model_len = counted
        room = max_model_len - prompt_tokens
        if room >= min(min_reply, max_tokens) or len(turns) <= 1:
            break
        turns.pop(0)
        dropped += 1
        while len(turns) > 1 and turns[0].get("role") != "user":  # history starts with a user turn
            turns.pop(0)
            dropped += 1
    if room < 1:
        raise ContextFull(f"This message is {prompt_tokens:,} tokens with the system prompt, and the model's context "
                          f"holds {max_model_len:,}: no room is left for a reply. Shorten the message or the system "
                          "prompt.")
    return Fit(system + turns, min(max_tokens, room), max_tokens, dropped, prompt_tokens, max_model_len)
