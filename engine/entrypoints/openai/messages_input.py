"""An Anthropic Messages request as the chat request it runs as: blocks → chat messages, tools, tool_choice.

`system` (a string or text blocks) becomes the first system message. A `system` turn inside `messages` stays where
it is when the chat template shows system messages there (prompts.renders_system_anywhere), and is otherwise
appended, in order, to that first system message, as Anthropic folds them. A user turn's text blocks become a
user message and its `tool_result` blocks tool messages (in block order; an `is_error` result's text
starts with "Error: "); an assistant turn's text becomes content, `tool_use` blocks tool calls (the
input object as JSON arguments) and `thinking` blocks reasoning_content. Tools (`input_schema`) become
function tools; tool_choice auto / any / tool / none becomes auto / required / named / none, and
`disable_parallel_tool_use` parallel_tool_calls=false. `thinking` enabled / adaptive / disabled, and
`output_config.effort`, become reasoning_effort; `output_config.format` becomes response_format;
`stop_sequences` become stop strings. A user turn's `image` blocks (source base64 with its media_type, or url)
become image_url parts in place among its text (the chat path fetches, checks and processes them; a model that
takes no images answers them with a 400 there). Documents and server tools are a 400 naming the field.
"""
from __future__ import annotations

import json
from typing import Any

from engine.entrypoints.openai.chat_request import chat_request
from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.protocol_messages import CountTokensRequest, MessagesRequest

_CHAT_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "reasoning_effort": "thinking",
               "response_format": "output_config.format"}
_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}
_IGNORED_BLOCK_KEYS = {"cache_control", "citations"}


def messages_field(chat_field: str | None) -> str | None:
    if chat_field is None:
        return None
    head, _, rest = chat_field.partition(".")
    return _CHAT_NAMES.get(head, head) + (f".{rest}" if rest else "")


def _block_text(blocks: str | list[dict[str, Any]], where: str) -> str:
    """Text blocks (system, a tool_result's content) as one string."""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{where}.{j} is a {kind!r} block; only text blocks are accepted here (image and "
                              "document input are not supported)", f"{where}.{j}")
        texts.append(block["text"])
    return "\n".join(texts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An Anthropic image block as an OpenAI image_url part (base64 as a data: URL)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad_request(f"{where}: an image block needs a source of type 'base64' (media_type, data) or 'url' (url)",
                      f"{where}.source")


def _user_turn(content: str | list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and image parts, once the turn has an image

    def flush() -> None:
        if parts:
            out.append({"role": "user", "content": parts + [{"type": "text", "text": t} for t in texts]})
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
        texts.clear()
        parts.clear()

    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "image":
            parts.extend([{"type": "text", "text": t} for t in texts] + [_image_part(block, f"{where}.{j}")])
            texts.clear()
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{where}.{j}.tool_use_id must be a string", f"{where}.{j}.tool_use_id")
            flush()
            text = _block_text(block.get("content", ""), f"{where}.{j}.content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": f"Error: {text}" if block.get("is_error") else text})
        else:
            raise bad_request(f"{where}.{j} is a {kind!r} block; user turns take text, image and tool_result "
                              "blocks (document input is not supported)", f"{where}.{j}")
    flush()
    return out


def _assistant_turn(content: str | list[dict[str, Any]], where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls, thinking = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise bad_request(f"{where}.{j}: a tool_use block needs an id, a name and an input object",
                                  f"{where}.{j}")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic's servers: nothing a local model can read
        else:
            raise bad_request(f"{where}.{j} is a {kind!r} block; assistant turns take text, tool_use and thinking "
                              "blocks", f"{where}.{j}")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def chat_messages(req: CountTokensRequest, system_in_place: bool = True) -> list[dict[str, Any]]:
    """The conversation as chat messages; `system_in_place`: system turns stay where they are (else they join the
    system prompt)."""
    systems = [_block_text(req.system, "system")] if req.system else []
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if m.role == "system":
            text = _block_text(m.content, where)
            if system_in_place:
                messages.append({"role": "system", "content": text})
            else:
                systems.append(text)
        else:
            messages += _user_turn(m.content, where) if m.role == "user" else [_assistant_turn(m.content, where)]
    system = "\n\n".join(t for t in systems if t)
    return ([{"role": "system", "content": system}] if system else []) + messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise bad_request(f"tools.{i}.type {tool.get('type')!r} is a server tool, which this server does not "
                              "run; send client tools (name, description, input_schema)", f"tools.{i}.type")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools.{i}.input_schema must be a JSON schema object", f"tools.{i}.input_schema")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request(f"tool_choice.type must be auto, any, tool (with a name) or none, got {kind!r}",
                      "tool_choice")


def reasoning_effort(req: CountTokensRequest) -> str | None:
    if req.thinking is not None and req.thinking.type == "disabled":
        return "none"
    if req.output_config is not None and req.output_config.effort is not None:
        return _EFFORT[req.output_config.effort]
    if req.thinking is not None:
        return "medium"
    return None


def check_messages_supported(req: CountTokensRequest) -> None:
    if req.mcp_servers:
        raise bad_request("mcp_servers is not supported: this server calls no MCP servers; run them client-side",
                          "mcp_servers")
    if isinstance(req, MessagesRequest) and req.container is not None:
        raise bad_request("container is not supported: there is no code-execution container", "container")


def to_chat_request(req: CountTokensRequest, system_in_place: bool = True) -> ChatCompletionRequest:
    check_messages_supported(req)
    choice, parallel = chat_tool_choice(req.tool_choice)
    forced = choice == "required" or isinstance(choice, dict)  # a forced call writes no text to format
    fmt = req.output_config.format if req.output_config and not forced else None
    payload: dict[str, Any] = {
        "model": req.model, "messages": chat_messages(req, system_in_place), "tools": chat_tools(req.tools),
        "tool_choice": choice,
        "parallel_tool_calls": parallel, "reasoning_effort": reasoning_effort(req),
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.json_schema}}
        if fmt is not None else None,
    }
    if isinstance(req, MessagesRequest):
        payload.update(max_completion_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                       top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                       structured_outputs=req.structured_outputs.model_dump(by_alias=True, exclude_unset=True)
                       if req.structured_outputs else None)
    return chat_request(payload, messages_field)
