"""ToolCall and the ToolParser base: the shared JSON reading of `{"name": ..., "arguments": {...}}` calls."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


def make_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it
    id: str = field(default_factory=make_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_from_json(obj: object, args_key: str = "arguments") -> ToolCall | None:
    """A ToolCall from a decoded `{"name": ..., "arguments"|"parameters": {...}}`, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    name = ""
    needs_special_tokens = False  # harmony: its markers are special tokens, so the text must keep them
    markers: tuple[str, ...] = ()

    def bind_tools(self, tools: list | None) -> None:
        """The request's tool definitions, for formats whose values are typed by the schema (qwen3_coder)."""

    def find_start(self, text: str) -> int | None:
        """Index where the tool-call section starts, or None."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """Length of a tail of `text` that may be the beginning of a marker (not shown yet)."""
        for n in range(min(max(map(len, self.markers)) - 1, len(text)), 0, -1):
            if any(m.startswith(text[-n:]) for m in self.markers):
                return n
        return 0

    def parse_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        """The calls in a tool-call section (complete ones only unless final); None: it is not tool calls."""
        raise NotImplementedError

    def open_call(self, section: str) -> tuple[str, str] | None:
        """(name, arguments so far) of a call still being written, for parsers that stream arguments."""
        return None

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """Non-streamed: (content, tool calls) of a whole output."""
        start = self.find_start(text)
        if start is None:
            return text, []
        calls = self.parse_calls(text[start:], final=True)
        if not calls:
            return text, []
        return text[:start], calls
