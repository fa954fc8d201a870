"""Reasoning parsers (vLLM's names): split a model's `<think>...</think>` text (or harmony's analysis channel,
harmony.py) from its answer.

`split(text, final)` works on the cumulative output and returns (reasoning, content) that are safe to
show now: a tail that may be the start of a tag is held back until the next token decides it, so a
stream never shows half a tag and the streamed deltas add up to the non-streamed message.
"""
from __future__ import annotations

from engine.reasoning.base import END, START, Qwen3ReasoningParser, ReasoningParser, held_back
from engine.reasoning.harmony import HarmonyReasoningParser

__all__ = ["END", "START", "HarmonyReasoningParser", "Qwen3ReasoningParser", "ReasoningParser", "held_back",
           "detect_reasoning_parser", "get_reasoning_parser"]


def _parsers() -> dict[str, type[ReasoningParser]]:
    return {"deepseek_r1": ReasoningParser, "qwen3": Qwen3ReasoningParser,
            "openai_gptoss": HarmonyReasoningParser, "harmony": HarmonyReasoningParser}


REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss", "harmony")


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """A reasoning parser the template's format cannot be read without (harmony's channels), else None:
    `<think>` parsers stay opt-in (--reasoning-parser), as in vLLM."""
    return "openai_gptoss" if "<|channel|>" in (chat_template or "") else None


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if not name:
        return None
    parsers = _parsers()
    if name not in parsers:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
    return parsers[name]()
