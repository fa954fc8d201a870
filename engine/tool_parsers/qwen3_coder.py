"""qwen3_coder: Qwen3-Coder / Qwen3.5 XML-style calls, `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
...</function></tool_call>`.

Parameter values are raw text, so they are typed by the request's own tool schema (`bind_tools`): a
string parameter keeps its text, integer / number / boolean / object / array values are read as JSON, and a
parameter the schema does not type is read as JSON when it parses, else kept as text. The arguments
object is written with its parameters in the model's order, one at a time as each `</parameter>` closes,
so a stream sends the arguments in pieces that add up to the final call's arguments.
"""
from __future__ import annotations

import json
import re
from typing import Any

from engine.tool_parsers.base import ToolCall, ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION = "<function="
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_JSON_TYPES = {"integer", "number", "boolean", "object", "array", "null"}


def _trim(value: str) -> str:
    """The value without the one newline the format puts after `<parameter=...>` and before its close."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _types(schema: dict | None) -> set[str]:
    kind = (schema or {}).get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return {t for s in (schema or {}).get("anyOf", []) or [] if isinstance(s, dict) for t in _types(s)}


def typed_value(raw: str, schema: dict | None) -> Any:
    types = _types(schema)
    if types == {"string"} or (types and not types & _JSON_TYPES):
        return raw
    text = raw.strip()
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return raw


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    markers = (OPEN, FUNCTION)

    def __init__(self) -> None:
        self.schemas: dict[str, dict] = {}  # function name -> its parameters' properties

    def bind_tools(self, tools: list | None) -> None:
        for tool in tools or []:
            function = tool.function
            self.schemas[function.name] = dict((function.parameters or {}).get("properties") or {})

    def _arguments(self, name: str, body: str, closed: bool) -> str:
        """The arguments JSON of the complete parameters in `body` (open: without the closing brace)."""
        properties = self.schemas.get(name, {})
        pieces = [f"{json.dumps(key.strip(), ensure_ascii=False)}: "
                  f"{json.dumps(typed_value(_trim(value), properties.get(key.strip())), ensure_ascii=False)}"
                  for key, value in _PARAMETER.findall(body)]
        text = "{" + ", ".join(pieces)
        return text + "}" if closed else text

    def parse_calls(self, section: str, final: bool) -> list[ToolCall] | None:
        calls = []
        for match in _FUNCTION.finditer(section):
            closed = bool(match.group(3))
            if not closed and not final:
                break
            calls.append(ToolCall(match.group(1).strip(), self._arguments(match.group(1).strip(), match.group(2),
                                                                          True)))
        if final and not calls:
            return None
        return calls

    def open_call(self, section: str) -> tuple[str, str] | None:
        last = None
        for match in _FUNCTION.finditer(section):
            last = match
        if last is None or last.group(3):
            return None
        name = last.group(1).strip()  # complete: the pattern needs the `>` that ends it
        args = self._arguments(name, last.group(2), False)
        return name, "" if args == "{" else args
