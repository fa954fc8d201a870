"""hermes: Qwen2.5/Qwen3/Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

A call written name-first (as these templates show it) keeps the model's own arguments text, so a stream
can send it in pieces while the block is still open (`open_call`) and the pieces add up to the final
call; other layouts are parsed whole once the block closes.
"""
from __future__ import annotations

import json
import re

from engine.tool_parsers.base import ToolCall, ToolParser, call_from_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _name(match: re.Match) -> str:
    return json.loads(f'"{match.group(1)}"')


def _parse_block(body: str) -> ToolCall | None:
    head = _HEAD.match(body)
    if head is not None:
        rest = body[head.end():].rstrip()
        raw = rest[:-1].rstrip() if rest.endswith("}") else ""
        try:
            if isinstance(json.loads(raw), dict):
                return ToolCall(_name(head), raw)
        except json.JSONDecodeError:
            pass
    try:
        return call_from_json(json.loads(body))
    except json.JSONDecodeError:
        return None


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)

    def parse_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        bodies = _BLOCK.findall(section)
        if final:
            tail = section[section.rfind(CLOSE) + len(CLOSE):] if bodies else section
            if tail.strip().startswith(OPEN):  # an unclosed last block (the model stopped on EOS)
                bodies.append(tail.strip()[len(OPEN):])
        calls = []
        for body in bodies:
            call = _parse_block(body)
            if call is None:
                return None
            calls.append(call)
        return calls

    def open_call(self, section: str) -> tuple[str, str] | None:
        """(name, arguments so far) of a name-first block still open at the end of `section`; the tail that
        may still turn out to close the call (`}`, whitespace, part of `</tool_call>`) is held back."""
        start = section.rfind(OPEN)
        if start < 0 or CLOSE in section[start:]:
            return None
        body = section[start + len(OPEN):]
        head = _HEAD.match(body)
        if head is None:
            return None
        args = body[head.end():]
        args = args[:len(args) - self.held_back_close(args)].rstrip(" \t\r\n}")
        return _name(head), args

    @staticmethod
    def held_back_close(text: str) -> int:
        for n in range(min(len(CLOSE) - 1, len(text)), 0, -1):
            if text.endswith(CLOSE[:n]):
                return n
        return 0
