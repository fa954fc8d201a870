"""Turn request prompts and chat messages into token ids, and check them against the model's limits.

Chat messages are rendered by the tokenizer's own `apply_chat_template` (transformers renders it in a
sandboxed Jinja environment). Everything the client sends (message content, names, tool calls, tool
definitions) is its text, never markup: special-token text in it ("</s><|system|>") is tokenized as plain
text, while the template's own special tokens stay special, so no one can forge a turn of another role.
Text longer than any prompt that could fit `max_model_len` (MAX_CHARS_PER_TOKEN characters per token, a
bound no real tokenizer reaches on average) is refused before it is tokenized. Everything a client can
get wrong here (empty prompt, ids outside the vocabulary, too long, images for a text model, tools for a
model whose template has none) raises `OpenAIError(400)` with the numbers. A vision-language model's image
parts (`image_url`: data:, file:// under --allowed-local-media-path, http(s) under --allowed-media-domains) are
rendered as the template's image placeholder, fetched and decoded here, and the rendered text and its images go
through the checkpoint's processor (engine/multimodal/processor.py), which expands each placeholder; an image
that cannot be used is a 400 naming its part. These functions run in the tokenizer pool (tokenize_pool.py).
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from engine.entrypoints.openai.errors import OpenAIError, bad_request
from engine.entrypoints.openai.protocol import ChatMessage
from engine.entrypoints.openai.served_model import ServedModel


MAX_CHARS_PER_TOKEN = 32


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]
    mm: Any = None  # its images (engine/multimodal/inputs.MultiModalInputs); token_ids are their expanded prompt


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise bad_request(f"{param} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param)


def check_prompt_chars(num_chars: int, max_model_len: int, param: str = "prompt") -> None:
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > limit:
        raise bad_request(f"the prompt has {num_chars} characters, more than any prompt that fits this model's "
                          f"maximum context length of {max_model_len} tokens can have ({limit} characters); "
                          "shorten the prompt", param)


def prompt_chars(prompt: str | list) -> int:
    """Characters in a completions prompt (all entries), for the cap and the tokenizer pool's lane."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, (str, list)))


def message_chars(messages: list[ChatMessage] | None) -> int:
    total = 0
    for m in messages or []:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(part.text or "") for part in m.content)
    return total


def encode(model: ServedModel, text: str, add_special_tokens: bool) -> list[int]:
    check_prompt_chars(len(text), model.max_model_len)
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


def message_text(message: ChatMessage, index: int, images_ok: bool = False) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for j, part in enumerate(message.content):
        if part.type == "image_url" and images_ok:
            continue  # the model takes images: image_parts() renders them
        if part.type != "text":
            takes = "text and image_url parts (audio and video input are not supported)" if images_ok else \
                "text only (this model takes no images; audio and video input are not supported)"
            raise bad_request(f"messages[{index}].content[{j}] is a {part.type!r} part; this server accepts "
                              f"{takes}", f"messages.{index}.content.{j}")
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


def has_images(messages: list[ChatMessage]) -> bool:
    return any(isinstance(m.content, list) and any(p.type == "image_url" for p in m.content) for m in messages)


def image_parts(message: ChatMessage, index: int) -> list[dict]:
    """A message with image parts as the content list VL templates take: text parts and {"type": "image"}."""
    message_text(message, index, images_ok=True)  # the checks: every part is text or an image
    return [{"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text} for p in message.content]


def image_urls(messages: list[ChatMessage]) -> list[tuple[str, str, str]]:
    """(URL, request field, the part in words) of every image part, in prompt order."""
    urls = []
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type == "image_url":
                value = (part.model_extra or {}).get("image_url")
                url = value.get("url") if isinstance(value, dict) else value
                where = f"messages.{i}.content.{j}"
                if not isinstance(url, str) or not url:
                    raise bad_request(f"messages[{i}].content[{j}] is an image_url part without image_url.url",
                                      where)
                urls.append((url, where, f"messages[{i}].content[{j}]"))
    return urls


def chat_messages(messages: list[ChatMessage], images_ok: bool = False) -> list[dict]:
    """Messages as the plain dicts chat templates expect (with `images_ok`, image parts as {"type": "image"})."""
    out = []
    for i, m in enumerate(messages):
        with_images = images_ok and isinstance(m.content, list) and any(p.type == "image_url" for p in m.content)
        d: dict = {"role": m.role, "content": image_parts(m, i) if with_images else message_text(m, i)}
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


def template_kwargs(model: ServedModel, chat_template_kwargs: dict | None, reasoning_effort: str | None) -> dict | None:
    """The client's chat_template_kwargs plus OpenAI's `reasoning_effort`, passed as the template reads it:
    `reasoning_effort` itself (gpt-oss style) and/or `enable_thinking` (Qwen3 style; off for "none"), only where
    the template source names that variable; a template reading neither gets nothing (the field has no effect).
    Keys the client set in chat_template_kwargs win."""
    if reasoning_effort is None:
        return chat_template_kwargs
    source = str(model.tokenizer.chat_template or "")
    derived: dict = {}
    if "reasoning_effort" in source:
        derived["reasoning_effort"] = reasoning_effort
    if "enable_thinking" in source:
        derived["enable_thinking"] = reasoning_effort != "none"
    return {**derived, **(chat_template_kwargs or {})} or None


def render_chat(model: ServedModel, messages: list[ChatMessage], tools: list | None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None) -> str:
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if tools and not model.supports_tools:
        raise bad_request(f"model {model.name!r} does not support tools: its chat template has no tool "
                          "section; send the request without 'tools', or force a call with tool_choice "
                          "'required' or a named function (the tools are then described in a system message)",
                          "tools")
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    if not model.tokenizer.chat_template:
        raise bad_request(f"model {model.name!r} has no chat template; use /v1/completions", "messages")
    clash = sorted(set(chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {clash}; use the request fields", "chat_template_kwargs")
    check_prompt_chars(message_chars(messages), model.max_model_len, "messages")
    return _apply_template(model, chat_messages(messages, model.supports_images), tools, add_generation_prompt,
                           continue_final_message, chat_template_kwargs)


_SYSTEM_PROBE = "pagedesk-system-probe"


def renders_system_anywhere(model: ServedModel) -> bool:
    """Whether the model's chat template shows a system message after the conversation started (Qwen's and Llama
    3's do; Gemma's and Mistral's raise or leave it out), found once by rendering a probe conversation."""
    if model.system_anywhere is None:
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "system", "content": _SYSTEM_PROBE}, {"role": "user", "content": "v"}]
        try:
            text = model.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that raises on the probe does not take them
            text = ""
        model.system_anywhere = _SYSTEM_PROBE in str(text)
    return model.system_anywhere


def _apply_template(model: ServedModel, dicts: list[dict], tools: list | None, add_generation_prompt: bool,
                    continue_final_message: bool, chat_template_kwargs: dict | None = None) -> str:
    try:
        return model.tokenizer.apply_chat_template(
            dicts, tools=_tool_dicts(tools) or None, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - a template refusing these messages is the client's error
        raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from None


def _tool_dicts(tools: list | None) -> list[dict]:
    return [t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else t for t in tools or []]


def _rendered_forms(text: str) -> tuple[str, ...]:
    """How a template may show a client's string: as it is, trimmed (Llama 3's `content | trim`), or inside
    JSON (`tojson`, with or without ASCII escapes, or Jinja's HTML-safe variant)."""
    inner = json.dumps(text, ensure_ascii=False)[1:-1]
    html_safe = (json.dumps(text)[1:-1].replace("<", "\\u003c").replace(">", "\\u003e")
                 .replace("&", "\\u0026").replace("'", "\\u0027"))
    return text, text.strip(), inner, json.dumps(text)[1:-1], html_safe


class _Marks:
    """Every client string holding special-token text, swapped for a unique marker."""

    def __init__(self, special: tuple[str, ...]) -> None:
        self.special, self.nonce = special, secrets.token_hex(8)
        self.texts: dict[str, str] = {}  # marker -> the client's string
        self.fields: dict[str, str] = {}  # marker -> where it was, e.g. "messages.2.tool_calls.0.function.name"

    def mark(self, value, where: str):
        if isinstance(value, str):
            if not any(s in value for s in self.special):
                return value
            marker = f"[[pagedesk-text-{self.nonce}-{len(self.texts)}]]"
            self.texts[marker], self.fields[marker] = value, where
            return marker
        if isinstance(value, dict):
            for key in value:
                if isinstance(key, str) and any(s in key for s in self.special):
                    raise bad_request(f"{where} has a key holding special-token text; rename it", where)
            return {k: v if k == "role" else self.mark(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [self.mark(v, f"{where}.{i}") for i, v in enumerate(value)]
        return value


def chat_token_ids(model: ServedModel, messages: list[ChatMessage], tools: list | None,
                   add_generation_prompt: bool, continue_final_message: bool,
                   add_special_tokens: bool = False, chat_template_kwargs: dict | None = None) -> Prompt:
    """The rendered chat and its ids: the template's own text with its special tokens, every string the client
    sent (content, names, tool calls and their arguments, tool definitions) as plain text. Strings holding
    special-token text are located exactly by rendering once more with a unique marker in their place
    (searching the rendered text could hit the template's own markers); the ids are then built piece by piece
    and must spell the first rendering exactly, else the request is refused rather than guessed at."""
    text = render_chat(model, messages, tools, add_generation_prompt, continue_final_message, chat_template_kwargs)
    check_prompt_chars(len(text), model.max_model_len, "messages")
    marks = _Marks(model.special_token_texts)
    dicts = [marks.mark(d, f"messages.{i}") for i, d in enumerate(chat_messages(messages, model.supports_images))]
    marked_tools = [marks.mark(t, f"tools.{i}") for i, t in enumerate(_tool_dicts(tools))]
    kwargs = marks.mark(chat_template_kwargs or {}, "chat_template_kwargs")
    if model.supports_images and has_images(messages):
        if marks.texts:
            field = next(iter(marks.fields.values()))
            raise bad_request(f"{field} holds special-token text, which a request with images cannot keep as plain "
                              "text; remove it", field)
        return image_prompt(model, messages, text, add_special_tokens)
    if not marks.texts:
        return Prompt(text, encode(model, text, add_special_tokens))
    marked = _apply_template(model, dicts, marked_tools, add_generation_prompt, continue_final_message, kwargs)
    pieces = re.split("(" + "|".join(map(re.escape, marks.texts)) + ")", marked)
    ids: list[int] = list(model.tokenizer.encode("", add_special_tokens=add_special_tokens))
    pos = 0
    for j, piece in enumerate(pieces):  # template text, marker, template text, ... (re.split's captures)
        if piece in marks.texts:
            after = pieces[j + 1]
            form = next((f for f in _rendered_forms(marks.texts[piece])
                         if text.startswith(f, pos) and text.startswith(after, pos + len(f))), None)
            if form is None:
                field = marks.fields[piece]
                raise bad_request(f"{field} holds special-token text, and the chat template does not show it as "
                                  "it is, so it cannot be kept as plain text; remove it", field)
            ids += model.text_tokenizer.encode(form, add_special_tokens=False)
            pos += len(form)
        elif piece:
            if not text.startswith(piece, pos):
                raise _renders_differently()
            ids += model.tokenizer.encode(piece, add_special_tokens=False)
            pos += len(piece)
    if pos != len(text):
        raise _renders_differently()
    return Prompt(text, ids)


def image_prompt(model: ServedModel, messages: list[ChatMessage], text: str, add_special_tokens: bool) -> Prompt:
    """The rendered chat with its images fetched, decoded and processed (each placeholder expanded)."""
    from engine.multimodal.media import MediaError, load_image
    urls = image_urls(messages)
    if model.image_limit is not None and len(urls) > model.image_limit:
        raise bad_request(f"the request has {len(urls)} images, more than this server takes per prompt "
                          f"({model.image_limit}, --limit-mm-per-prompt)", urls[model.image_limit][1])
    images = []
    for url, where, what in urls:
        try:
            images.append(load_image(url, model.media_limits, f"{what} (image_url)"))
        except MediaError as exc:
            raise bad_request(str(exc), where) from None
    try:
        mm = model.mm_processor.process(text, images, add_special_tokens)
    except ValueError as exc:
        raise bad_request(f"the images cannot be processed: {exc}", "messages") from None
    return Prompt(text, mm.prompt_token_ids, mm)


def _renders_differently() -> OpenAIError:
    return bad_request("the chat template renders differently when special-token text is kept out of it, so it "
                       "cannot be kept as plain text; remove it", "messages")


def chat_prompt(model: ServedModel, messages: list[ChatMessage], tools: list | None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None, add_special_tokens: bool = False) -> Prompt:
    prompt = chat_token_ids(model, messages, tools, add_generation_prompt, continue_final_message,
                            add_special_tokens, chat_template_kwargs)
    if not prompt.token_ids:
        raise bad_request("the rendered chat prompt is empty", "messages")
    return prompt


def truncate_prompt(prompt: Prompt, keep: int | None, max_model_len: int, side: str | None = None) -> Prompt:
    """vLLM's truncate_prompt_tokens: keep `keep` tokens (-1: max_model_len), the last ones (truncation_side
    "left", the default) or the first ("right"); None leaves it whole."""
    if keep is None:
        return prompt
    if prompt.mm is not None and len(prompt.token_ids) > (max_model_len if keep == -1 else keep):
        raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens")
    if keep == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1, got 0", "truncate_prompt_tokens")
    keep = max_model_len if keep == -1 else keep
    if len(prompt.token_ids) <= keep:
        return prompt
    return Prompt(None, prompt.token_ids[:keep] if side == "right" else prompt.token_ids[-keep:])


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
