"""openai (vLLM's name; also `harmony`): gpt-oss tool calls, harmony messages addressed `to=functions.NAME`
whose body is the arguments JSON (engine/reasoning/harmony.py reads the format).

It reads the canonical call messages the harmony reasoning parser leaves in the content, and raw
harmony text as well; a call's arguments stream while its message is open, in pieces that add up to
the final call's arguments.
"""
from __future__ import annotations

import json

from engine.reasoning.harmony import START, read_messages
from engine.tool_parsers.base import ToolCall, ToolParser

PREFIX = "functions."


def _is_call(message) -> bool:
    return message.header_done and (message.recipient or "").startswith(PREFIX)


def _arguments(body: str) -> str | None:
    text = body.strip() or "{}"
    try:
        return text if isinstance(json.loads(text), dict) else None
    except json.JSONDecodeError:
        return None


class HarmonyToolParser(ToolParser):
    name = "openai"
    markers = (START,)
    needs_special_tokens = True

    def find_start(self, text: str) -> int | None:
        return next((m.start for m in read_messages(text, final=False) if _is_call(m)), None)

    def held_back(self, text: str) -> int:
        """A tail that may still become a call's header: from the last `<|start|>` without a body yet."""
        last = text.rfind(START)
        if last >= 0 and "<|message|>" not in text[last:]:
            return len(text) - last
        return super().held_back(text)

    def parse_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        calls = []
        for m in read_messages(section, final):
            if not _is_call(m) or not (m.done or final):
                continue
            arguments = _arguments(m.body)
            if arguments is None:
                if final:
                    return None
                continue
            calls.append(ToolCall(m.recipient[len(PREFIX):], arguments))
        return calls if calls or not final else None

    def open_call(self, section: str) -> tuple[str, str] | None:
        messages = read_messages(section, final=False)
        last = messages[-1] if messages else None
        if last is None or not _is_call(last) or last.done:
            return None
        return last.recipient[len(PREFIX):], last.body.lstrip().rstrip(" \t\r\n}")
