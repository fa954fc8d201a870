"""Forced tool calls on a model whose chat template has no tool section: the tools go in a system preamble.

With tool_choice `required` or a named function the grammar decides the output's shape (structured.py's
`tool_call_schema`), so the model needs no template support to call correctly; it only needs to know what
the tools are for. We describe them in a system message of our own (merged into the client's first system
message, if there is one) and leave the template alone: it renders plain messages. The preamble states
the shape the grammar enforces, so a capable model writes what it is held to anyway. `auto` still needs a
template that shows tools and a parser that reads calls back, and stays a 400.
"""
from __future__ import annotations

import json
from typing import Any

from engine.entrypoints.openai.protocol import ChatMessage, ToolDefinition


def tool_preamble(tools: list[ToolDefinition], tool_choice: Any) -> str:
    """The system text describing `tools` and the call the grammar forces (`required` or a named function)."""
    described = "\n".join(json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    if tool_choice == "required":
        shape = ('Reply with only a JSON list of calls, each {"name": <function name>, "parameters": <its '
                 "arguments>}.")
    else:
        shape = (f"Call the function {tool_choice.function.name!r}: reply with only its arguments, as one JSON "
                 "object matching its parameters.")
    return f"You have these functions (JSON schema of each):\n{described}\n{shape}"


def with_tool_preamble(messages: list[ChatMessage], tools: list[ToolDefinition],
                       tool_choice: Any) -> list[ChatMessage]:
    """`messages` with the preamble as the system message (before the client's own system text, if any)."""
    preamble = tool_preamble(tools, tool_choice)
    first = messages[0]
    if first.role in ("system", "developer") and (first.content is None or isinstance(first.content, str)):
        merged = first.model_copy(update={"content": f"{preamble}\n\n{first.content or ''}".rstrip()})
        return [merged, *messages[1:]]
    return [ChatMessage(role="system", content=preamble), *messages]
