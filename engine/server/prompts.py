"""Turn request prompts and chat messages into token ids, and check them against the model's limits.

Chat messages are rendered by the tokenizer's own `apply_chat_template` (transformers renders it in a
sandboxed Jinja environment). Everything a client can get wrong here (empty prompt, ids outside the
vocabulary, too long for `max_model_len`, images for a text model, tools for a model whose template
has none) raises `OpenAIError(400)` with the numbers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.server.errors import bad_request
from engine.server.protocol import ChatMessage
from engine.server.served_model import ServedModel


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise bad_request(f"{param} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param)


def encode(model: ServedModel, text: str, add_special_tokens: bool) -> list[int]:
    return list(model.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def completion_prompts(model: ServedModel, prompt: str | list, add_special_tokens: bool) -> list[Prompt]:
    """A completions `prompt` (string, strings, ids, or id lists) as one Prompt per entry."""
    if isinstance(prompt, str):
        entries: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        entries = [list(prompt)]
    else:
        entries = list(prompt)
    if not entries:
        raise bad_request("prompt must not be empty", "prompt")
    prompts = []
    for entry in entries:
        if isinstance(entry, str):
            if not entry:
                raise bad_request("prompt must not be empty", "prompt")
            prompts.append(Prompt(entry, encode(model, entry, add_special_tokens)))
        else:
            if not entry:
                raise bad_request("prompt must not be empty", "prompt")
            check_token_ids(entry, model.vocab_size, "prompt")
            prompts.append(Prompt(None, list(entry)))
    return prompts


def message_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text":
            raise bad_request(f"messages[{index}] has a {part.type!r} part; this model accepts text only",
                              f"messages.{index}.content")
        if part.text is None:
            raise bad_request(f"messages[{index}] has a text part without 'text'", f"messages.{index}.content")
        texts.append(part.text)
    return "\n".join(texts)


def _template_tool_calls(calls: list[dict], index: int) -> list[dict]:
    """OpenAI sends arguments as JSON text; chat templates (Qwen, Llama, Mistral) expect the object."""
    out = []
    for call in calls:
        call = dict(call)
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"] or "{}")
            except json.JSONDecodeError:
                raise bad_request(f"messages[{index}].tool_calls arguments are not valid JSON",
                                  f"messages.{index}.tool_calls") from None
        call["function"] = function
        out.append(call)
    return out


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the plain dicts chat templates expect."""
    out = []
    for i, m in enumerate(messages):
        d: dict = {"role": m.role, "content": message_text(m, i)}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            value = getattr(m, key)
            if value is not None:
                d[key] = _template_tool_calls(value, i) if key == "tool_calls" else value
        if m.reasoning is not None and m.reasoning_content is None:
            d["reasoning_content"] = m.reasoning
        out.append(d)
    return out


_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
                             "conversation", "chat_template", "documents", "return_dict"}


def render_chat(model: ServedModel, messages: list[ChatMessage], tools: list | None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None) -> str:
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if tools and not model.supports_tools:
        raise bad_request(f"model {model.name!r} does not support tools: its chat template has no tool "
                          "section; send the request without 'tools'", "tools")
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    if not model.tokenizer.chat_template:
        raise bad_request(f"model {model.name!r} has no chat template; use /v1/completions", "messages")
    clash = sorted(set(chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {clash}; use the request fields", "chat_template_kwargs")
    dicts = chat_messages(messages)
    tool_dicts = [t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else t for t in tools or []]
    try:
        return model.tokenizer.apply_chat_template(
            dicts, tools=tool_dicts or None, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - a template refusing these messages is the client's error
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from None


def chat_prompt(model: ServedModel, messages: list[ChatMessage], tools: list | None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None) -> Prompt:
    text = render_chat(model, messages, tools, add_generation_prompt, continue_final_message, chat_template_kwargs)
    ids = encode(model, text, add_special_tokens=False)
    if not ids:
        raise bad_request("the rendered chat prompt is empty", "messages")
    return Prompt(text, ids)


def truncate_prompt(prompt: Prompt, keep: int | None, max_model_len: int) -> Prompt:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: max_model_len); None leaves it whole."""
    if keep is None:
        return prompt
    if keep == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1, got 0", "truncate_prompt_tokens")
    keep = max_model_len if keep == -1 else keep
    if len(prompt.token_ids) <= keep:
        return prompt
    return Prompt(None, prompt.token_ids[-keep:])


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       param: str = "max_tokens") -> int:
    """The output budget: as requested, or what is left of the context; 400 when it does not fit."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                          f"{num_prompt_tokens} tokens; shorten the prompt", "prompt")
    if requested is None:
        return max_model_len - num_prompt_tokens
    if requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}", param)
    if num_prompt_tokens + requested > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} "
                          f"for the completion). Reduce the prompt or {param}.", param)
    return requested
