"""The request body of POST /v1/responses (OpenAI's Responses API) as a pydantic model.

Every field of OpenAI's ResponseCreateParams is declared, so none is an "unknown field"; the ones that mean
something here are carried to the chat path (responses_input.py), the others are accepted at the values
that ask for nothing we lack and refused by value otherwise (`check_responses_supported`), as on the chat
route. Input items and tools stay plain dicts here and are read, with a 400 naming `input.<i>.<field>`, by
responses_input.py. vLLM's sampling extras (top_k, min_p, repetition_penalty, seed, stop,
structured_outputs) ride along as in vLLM's own Responses request.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from engine.sample.sampling_params import INT64_LIMIT, MAX_STOP_STRINGS
from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.refusals import check_stream_options
from engine.entrypoints.openai.protocol import (MAX_TEMPERATURE, Metadata, RequestBody, StopText, StreamOptions,
                                               StructuredOutputsField, Text, _Request, null_is)


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # the reasoning is returned whole, not summarised
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # deprecated name of summary


class TextConfig(_Request):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted without effect


class ResponsesRequest(RequestBody):
    model: Text | None = None
    input: Text | list[dict[str, Any]] = Field(..., description="A string (one user message) or a list of items")
    instructions: Text | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=INT64_LIMIT)
    max_tool_calls: int | None = Field(None, ge=1, lt=INT64_LIMIT)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: Annotated[bool, null_is(False)] = False
    stream_options: StreamOptions | None = None
    store: bool | None = None  # default true: kept in the server's bounded in-memory store (responses_store.py)
    previous_response_id: Text | None = None
    metadata: Metadata | None = None  # kept with a stored response: OpenAI's limits keep it small
    client_metadata: dict[str, Any] | None = None  # Codex's turn ids and headers: accepted, nothing is stored
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Text] | None = None
    service_tier: Text | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, lt=INT64_LIMIT)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    seed: int | None = Field(None, ge=-1, lt=2**63)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    structured_outputs: StructuredOutputsField | None = None
    request_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")] | None = None
    priority: int = Field(0, ge=-2**31, lt=2**31)
    cache_salt: Text | None = None


# Included data this server can give: none of OpenAI's includables name something it has (logprobs are
# not returned on this route, reasoning is returned as text, not encrypted), so only an empty list passes,
# except the reasoning one, which asks for what the reply already holds in the clear.
_INCLUDABLE = {"reasoning.encrypted_content"}


def check_responses_supported(req: ResponsesRequest) -> None:
    """400 naming the first field whose value asks for something this server does not do."""
    refusals = [
        ("background", req.background, "responses run in the foreground", lambda v: not v),
        ("conversation", req.conversation, "there is no conversations API; chain with previous_response_id",
         lambda v: v is None),
        ("prompt", req.prompt, "there are no stored prompt templates", lambda v: v is None),
        ("context_management", req.context_management, "no server-side compaction", lambda v: not v),
        ("moderation", req.moderation, "there is no moderation model", lambda v: v is None),
        ("service_tier", req.service_tier, "one service tier", lambda v: v in (None, "auto", "default")),
        ("prompt_cache_retention", req.prompt_cache_retention, "the prefix cache lives in memory",
         lambda v: v in (None, "in_memory")),
        ("top_logprobs", req.top_logprobs, "logprobs are not returned on /v1/responses", lambda v: not v),
        ("include", req.include, f"only {sorted(_INCLUDABLE)} (the reasoning text is returned in the clear)",
         lambda v: not v or set(v) <= _INCLUDABLE),
    ]
    check_stream_options(req)
    for field, value, why, ok in refusals:
        if not ok(value):
            raise bad_request(f"{field}={value!r} is not supported on /v1/responses: {why}", field)
