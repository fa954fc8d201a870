"""Tool-call parsers (vLLM's names: hermes, llama3_json, mistral, qwen3_coder, openai for gpt-oss's harmony) and their detection from a chat template.

A parser turns a model's text into (content, tool calls). It works on the cumulative output: `find_start`
says where the tool-call section begins (content before it streams as content; a tail that may be the
start of a marker is held back), and `parse_calls` reads the calls of that section, the complete ones
only until the output is final. Text that looked like a tool call but does not parse stays content.
"""
from __future__ import annotations

from engine.tool_parsers.base import ToolCall, ToolParser
from engine.tool_parsers.harmony import HarmonyToolParser
from engine.tool_parsers.hermes import HermesToolParser
from engine.tool_parsers.llama3_json import Llama3JsonToolParser
from engine.tool_parsers.mistral import MistralToolParser
from engine.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, Qwen3CoderToolParser,
                                    HarmonyToolParser)}
TOOL_PARSERS["harmony"] = HarmonyToolParser  # the format's own name, beside vLLM's "openai"

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParser", "detect_tool_parser", "get_tool_parser"]


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool-call format needs, or None when it shows none."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "openai"
    if "<function=" in template:  # Qwen3-Coder / Qwen3.5 write <tool_call><function=...>: before hermes
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def get_tool_parser(name: str | None) -> ToolParser | None:
    if not name:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]()
