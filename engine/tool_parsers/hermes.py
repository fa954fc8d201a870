"""hermes: Qwen2.5/Qwen3/Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""
from __future__ import annotations

import json
import re

from engine.tool_parsers.base import ToolCall, ToolParser, call_from_json

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def parse_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        bodies = _BLOCK.findall(section)
        if final:
            tail = section[section.rfind("</tool_call>") + len("</tool_call>"):] if bodies else section
            if tail.strip().startswith("<tool_call>"):  # an unclosed last block (the model stopped on EOS)
                bodies.append(tail.strip()[len("<tool_call>"):])
        calls = []
        for body in bodies:
            try:
                call = call_from_json(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return None
            calls.append(call)
        return calls
