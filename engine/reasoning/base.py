"""The `<think>` reasoning parsers (deepseek_r1, qwen3) and what every reasoning parser shares.

`split(text, final)` works on the cumulative output and returns (reasoning, content) that are safe to
show now: a tail that may be the start of a tag is held back until the next token decides it, so a
stream never shows half a tag and the streamed deltas add up to the non-streamed message.
"""
from __future__ import annotations

START, END = "<think>", "</think>"


def held_back(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """deepseek_r1: everything before `</think>` is reasoning, whether or not the model wrote `<think>`
    (R1's template opens the tag in the prompt)."""

    name = "deepseek_r1"
    needs_special_tokens = False  # harmony's markers are special tokens: its parser reads them

    def split(self, text: str, final: bool) -> tuple[str, str]:
        body = text[len(START):] if text.startswith(START) else text
        if not final and START.startswith(text):
            return "", ""
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):]
        return (body if final else body[:len(body) - held_back(body, END)]), ""


class Qwen3ReasoningParser(ReasoningParser):
    """qwen3: reasoning only when the output opens with `<think>` (with thinking off, Qwen3's template
    writes an empty think block into the prompt and the answer is all content)."""

    name = "qwen3"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        if not final and START.startswith(stripped):
            return "", ""
        if not stripped.startswith(START):
            return "", text
        return super().split(stripped, final)
