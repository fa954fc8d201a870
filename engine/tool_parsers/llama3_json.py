"""llama3_json: Llama 3.1+ JSON tool calls, `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several separated by `;`. The output must open with the call (after whitespace)."""
from __future__ import annotations

import json

from engine.tool_parsers.base import ToolCall, ToolParser, call_from_json

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (TAG, "{")

    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if TAG.startswith(stripped) else 0

    def parse_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        if not final:
            return []
        body = section.strip().removeprefix(TAG).strip()
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return None
            call = call_from_json(obj, "parameters")
            if call is None:
                return None
            calls.append(call)
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return calls
