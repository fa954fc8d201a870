"""Anthropic's output side: reply blocks as content blocks, the stream's events, stop_reason and usage.

Blocks (output_blocks.py) map to `thinking` (reasoning), `text` (content) and `tool_use` (a call: its
arguments JSON as the `input` object; ids start with `toolu_`). A stream sends message_start, ping,
per block content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) /
content_block_stop, then message_delta (stop_reason, stop_sequence, output tokens) and message_stop, in
Anthropic's order, which the anthropic SDK's stream helper accumulates into the same message.
"""
from __future__ import annotations

import json
from typing import Any

from engine.entrypoints.openai.output_blocks import Block, BlockEvent


def tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or "").removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    """The call's input object; a call cut short by max_tokens has no complete object: empty."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_block(block: Block, started: bool = False) -> dict[str, Any]:
    """The block whole, or (`started`) as content_block_start shows it, empty."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if started else block.text, "signature": ""}
    if block.kind == "call":
        return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name,
                "input": {} if started else _input(block.text)}
    return {"type": "text", "text": "" if started else block.text}


def block_events(ev: BlockEvent) -> list[dict[str, Any]]:
    block = ev.block
    if ev.action == "open":
        return [{"type": "content_block_start", "index": block.index, "content_block": content_block(block, True)}]
    if ev.action == "close":
        return [{"type": "content_block_stop", "index": block.index}]
    if block.kind == "reasoning":
        delta = {"type": "thinking_delta", "thinking": ev.piece}
    elif block.kind == "call":
        delta = {"type": "input_json_delta", "partial_json": ev.piece}
    else:
        delta = {"type": "text_delta", "text": ev.piece}
    return [{"type": "content_block_delta", "index": block.index, "delta": delta}]


def stop_reason(finish_reason: str | None, stop: int | str | None, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason and the stop string that matched."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic counts input_tokens without the cached prefix, which it reports apart."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def message_object(message_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
                   sequence: str | None, use: dict[str, int]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": use}
