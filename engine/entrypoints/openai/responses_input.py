"""A Responses API request as the chat request it runs as: input items → messages, tools, text.format, reasoning.

`instructions` becomes the first system message; `input` (a string, or message / function_call /
function_call_output / reasoning items) becomes chat messages (consecutive function calls join one
assistant turn, as chat templates show them); tools become chat tools (responses_tools.py); `text.format`
becomes response_format (dropped on a turn whose tool_choice forces a call: that turn writes no text);
`reasoning.effort` becomes reasoning_effort; `max_output_tokens` becomes
max_completion_tokens. Reasoning items sent back are accepted and dropped (chat templates drop earlier
turns' reasoning); a `compaction` item (routes_compact.py) becomes a user message holding its summary. An
`input_image` part (image_url: a data:, file:// or http(s) URL) becomes an image_url part in place (the chat path
fetches, checks and processes it, or answers 400 for a model that takes no images); anything else the chat path
cannot run (files, file_id images) is a 400 naming the input field.
"""
from __future__ import annotations

import json
from functools import partial
from typing import Any, Callable

from engine.entrypoints.openai.chat_request import chat_request
from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.protocol_responses import ResponsesRequest
from engine.entrypoints.openai.responses_tools import ResponsesTools, chat_tool_choice, flat_name, responses_tools

_TEXT_PARTS = ("input_text", "output_text", "text")
COMPACTED_PREFIX = "A summary of the conversation so far, written before it was compacted:\n\n"
_CHAT_NAMES = {"max_completion_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort",
               "response_format": "text.format"}


def responses_field(chat_field: str | None) -> str | None:
    """A chat request's field path named as the Responses request names it."""
    if chat_field is None:
        return None
    head, _, rest = chat_field.partition(".")
    return _CHAT_NAMES.get(head, head) + (f".{rest}" if rest else "")


def _text_of(content: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    """A message's content: a string, or text parts (input_text / output_text); refusal parts as their text.
    With `images` (a user turn), input_image parts are kept in place: the content is then chat parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind == "input_image" and images and isinstance(part.get("image_url"), str):
            parts += [{"type": "text", "text": t} for t in texts] + [
                {"type": "image_url", "image_url": {"url": part["image_url"]}}]
            texts = []
        else:
            accepted = "input_text, output_text and input_image with an image_url" if images else \
                "input_text, output_text"
            raise bad_request(f"{where}.{j} is a {kind!r} part; this server accepts {accepted} here",
                              f"{where}.{j}")
    if parts:
        return parts + [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def _output_text(output: Any, where: str) -> str:
    """A function_call_output's output: a string, or text parts."""
    return output if isinstance(output, str) else _text_of(output, where)


def input_messages(items: str | list[dict[str, Any]], sources: list[str] | None = None) -> list[dict[str, Any]]:
    """The `input` as chat message dicts; `sources` gets each message's input path (its first item's)."""
    if isinstance(items, str):
        if sources is not None:
            sources.append("input")
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if sources is not None:
            del sources[len(messages):]  # an item that added no message (reasoning, a joined call) names none
            sources.append(f"input.{i}")
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer, got {role!r}",
                                  f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content", ""), f"{where}.content",
                                                               images=role == "user")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
            try:
                json.loads(item["arguments"] or "{}")
            except json.JSONDecodeError:
                raise bad_request(f"{where}.arguments is not valid JSON", f"{where}.arguments") from None
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": flat_name(item["name"], item.get("namespace")),
                                 "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _output_text(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning: chat templates leave it out of the prompt
        elif kind in ("compaction", "compaction_summary"):  # /v1/responses/compact's summary, in plain text
            if not isinstance(item.get("encrypted_content"), str):
                raise bad_request(f"{where}.encrypted_content must be a string", f"{where}.encrypted_content")
            messages.append({"role": "user", "content": COMPACTED_PREFIX + item["encrypted_content"]})
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported: input items are message, function_call, "
                              "function_call_output, reasoning and compaction", f"{where}.type")
    if not messages:
        raise bad_request("input holds no message", "input")
    if sources is not None:
        del sources[len(messages):]
    return messages


def response_format(text_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format (json_schema's fields sit flat on the Responses side)."""
    if not text_format or text_format.get("type") in (None, "text"):
        return None
    kind = text_format.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: text_format[k] for k in ("name", "description", "schema", "strict") if k in text_format}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format.type")


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]
                    ) -> tuple[ChatCompletionRequest, list[dict[str, Any]], ResponsesTools, Callable]:
    """The chat request, the conversation (without instructions) a stored response keeps for chaining, the
    tools as the model sees them, and how a chat field is named in this request (a message's by its input item)."""
    sources: list[str] = []
    conversation = history + input_messages(req.input, sources)
    paths = ["instructions"] * bool(req.instructions) + ["previous_response_id"] * len(history) + sources
    tools = responses_tools(req.tools)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    # text.format shapes the reply's text; a forced call has none (the agents SDK sends both on a forced turn)
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
    text_format = req.text.format if req.text and not forced else None
    payload = {
        "model": req.model, "messages": system + conversation, "tools": tools.chat,
        "tool_choice": chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(text_format),
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty, "seed": req.seed,
        "stop": req.stop, "structured_outputs": req.structured_outputs.model_dump(by_alias=True, exclude_unset=True)
        if req.structured_outputs else None, "request_id": req.request_id, "priority": req.priority,
        "cache_salt": req.cache_salt,
    }
    return chat_request(payload, responses_field), conversation, tools, partial(_input_field, paths)


def _input_field(paths: list[str], chat_field: str | None) -> str | None:
    """responses_field, with `messages.N...` named by the input item message N came from."""
    if chat_field and chat_field.startswith("messages."):
        index, _, rest = chat_field.removeprefix("messages.").partition(".")
        if index.isdigit() and int(index) < len(paths):
            path = paths[int(index)]
            return path + (f".{rest}" if rest and path.startswith("input.") else "")
    return responses_field(chat_field)
