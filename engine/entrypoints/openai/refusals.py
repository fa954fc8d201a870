"""Request fields of the OpenAI and vLLM APIs that this server does not implement, and the values it accepts.

Each field is declared on the request models (so a client sending it is not an "unknown field"), but a
value that asks for behaviour we do not provide is refused with a 400 naming the field, never silently
ignored. A value that asks for what we do anyway (`service_tier: "auto"`) passes, so
clients that always send such defaults keep working. docs/server.md lists this table and a test walks
it; `refused_example` is a value each entry must refuse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from engine.entrypoints.openai.errors import bad_request


def _unset(value: Any) -> bool:
    return value is None or value == [] or value == {}


@dataclass(frozen=True)
class Refusal:
    field: str
    accepts: str  # the accepted values, in words (docs/server.md shows this)
    why: str
    refused_example: Any
    ok: Callable[[Any], bool] = _unset
    default: Any = None


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in values


REFUSALS = [
    Refusal("audio", "null", "audio output is not supported", {"voice": "alloy", "format": "wav"}),
    Refusal("modalities", 'null or ["text"]', "only text output", ["text", "audio"],
            lambda v: v is None or v == ["text"]),
    Refusal("prediction", "null", "predicted outputs are not supported", {"type": "content", "content": "x"}),
    Refusal("web_search_options", "null", "there is no web search", {"search_context_size": "low"}),
    Refusal("functions", "null", "deprecated by OpenAI; send `tools`", [{"name": "f"}]),
    Refusal("function_call", "null", "deprecated by OpenAI; send `tool_choice`", "auto"),
    Refusal("moderation", "null", "there is no moderation model", {"input": {"mode": "block"}}),
    Refusal("service_tier", 'null, "auto" or "default"', "one service tier", "flex", _is("auto", "default")),
    Refusal("prompt_cache_retention", 'null or "in_memory"', "the prefix cache lives in memory", "24h",
            _is("in_memory")),
    Refusal("spaces_between_special_tokens", "true", "the detokenizer has one spacing mode",
            False, _is(True)),
    Refusal("documents", "null", "RAG documents are not passed to chat templates", [{"text": "x"}]),
    Refusal("chat_template", "null", "only the model's own chat template is used", "{{ messages }}"),
    Refusal("mm_processor_kwargs", "null", "text-only models", {"size": 1}),
    Refusal("media_io_kwargs", "null", "text-only models", {"size": 1}),
    Refusal("prompt_embeds", "null", "prompts are text or token ids", "AAAA"),
    Refusal("guided_decoding_backend", 'null, "auto" or "xgrammar"', "xgrammar is the grammar engine", "outlines",
            _is("auto", "xgrammar")),
    Refusal("guided_whitespace_pattern", "null", "JSON is generated compact", r"[ ]?"),
    Refusal("logits_processors", "null", "custom logits processors are not supported", ["x"]),
    Refusal("kv_transfer_params", "null", "no disaggregated prefill", {"do_remote_prefill": True}),
    Refusal("vllm_xargs", "null", "no extra engine arguments", {"x": 1}),
    Refusal("suffix", 'null or ""', "insertion (suffix) is not supported", "end", _is("")),
    Refusal("logprob_token_ids", "null or []", "logprobs are returned for the sampled and the top tokens, not for "
            "chosen ids", [1, 2]),
]
BY_FIELD = {r.field: r for r in REFUSALS}


def refuse_unsupported(req: Any) -> None:
    """400 naming the first field whose value asks for something this server does not do."""
    check_stream_options(req)
    for r in REFUSALS:
        value = req
        for part in r.field.split("."):
            value = getattr(value, part, None)
        if not r.ok(value):
            raise bad_request(f"{r.field}={_short(value)} is not supported: {r.why}; accepted: {r.accepts}",
                              r.field)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_stream_options(req: Any) -> None:
    """OpenAI and vLLM refuse stream_options without stream: the options would silently do nothing."""
    if getattr(req, "stream_options", None) is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
