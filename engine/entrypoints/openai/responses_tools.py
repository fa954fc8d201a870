"""A Responses request's `tools` as the chat tools the model sees: function tools, namespaces flattened, hosted
tools ignored.

A `namespace` tool (Codex's `multi_agent_v1`: a named group of function tools) becomes its function tools, each
named `<namespace>.<name>` for the model; a call the model makes to one goes back to the client as OpenAI sends
it, `{"name": <name>, "namespace": <namespace>}`, and a replayed call with a namespace is read the same way.
Hosted tools (web_search, file_search, code_interpreter, image_generation, mcp, ...) run on OpenAI's servers;
this server has none, so each is ignored with a note (the x-pagedesk-ignored-fields header and a log line; a
400 under --strict-request-fields): Codex sends web_search on every turn and no client setting but its own
`web_search = "disabled"` removes it. The Response object echoes the function tools as Open Responses
describes them (description, parameters and strict always present).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.ignored_fields import ignore

_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_KNOWN_KEYS = {"type", *_FUNCTION_KEYS, "defer_loading"}


def flat_name(name: str, namespace: str | None) -> str:
    return f"{namespace}.{name}" if namespace else name


@dataclass
class ResponsesTools:
    chat: list[dict[str, Any]] | None = None  # chat's nested function tools; None: no tools
    echo: list[dict[str, Any]] = field(default_factory=list)  # the Response object's `tools`
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat name -> (namespace, name)

    def call_item_names(self, flat: str | None) -> dict[str, str]:
        """`name` (and `namespace`) of a function_call item for the model's call of `flat`."""
        if flat in self.namespaced:
            namespace, name = self.namespaced[flat]
            return {"name": name, "namespace": namespace}
        return {"name": flat or ""}


def _function(tool: dict[str, Any], where: str, namespace: str | None = None) -> dict[str, Any]:
    for key in sorted(set(tool) - _KNOWN_KEYS):
        ignore(f"{where}.{key}")
    if not isinstance(tool.get("name"), str):
        raise bad_request(f"{where}.name must be a string", f"{where}.name")
    function = {k: tool[k] for k in _FUNCTION_KEYS if k in tool}
    function["name"] = flat_name(tool["name"], namespace)
    return function


def responses_tools(tools: list[dict[str, Any]] | None) -> ResponsesTools:
    out = ResponsesTools()
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or []):
        kind, where = tool.get("type"), f"tools.{i}"
        if kind == "function":
            functions.append(_function(tool, where))
            out.echo.append(_echoed(tool))
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not isinstance(tool.get("tools"), list):
                raise bad_request(f"{where}: a namespace tool needs a name and a list of tools", where)
            for j, member in enumerate(tool["tools"]):
                if not isinstance(member, dict) or member.get("type") != "function":
                    ignore(f"{where}.tools.{j}", "only function tools run inside a namespace here")
                    continue
                function = _function(member, f"{where}.tools.{j}", namespace)
                out.namespaced[function["name"]] = (namespace, member["name"])
                functions.append(function)
                out.echo.append({**_echoed(member), "namespace": namespace})
        else:
            ignore(f"{where}.type", f"{kind!r} is a hosted tool, which this server does not run (a function tool "
                                    "is run by the client)")
    out.chat = [{"type": "function", "function": f} for f in functions] or None
    return out


def _echoed(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": flat_name(choice["name"], choice.get("namespace"))}}
    raise bad_request(f"tool_choice {choice!r} is not supported: send none, auto, required or "
                      '{"type": "function", "name": ...}', "tool_choice")
