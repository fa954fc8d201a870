"""Request bodies of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) as pydantic models.

The fields of Anthropic's MessageCreateParams are declared (older SDKs' temperature / top_p / top_k too), so
none is an "unknown field" (plus vLLM's seed and structured_outputs extras); what the chat path can run is carried to it (messages_input.py), and values
that ask for what this server lacks (server tools, containers, MCP servers) are refused by value with a
400 naming the field. Content blocks and tools stay plain dicts here and are read, with a 400 naming
`messages.<i>.content.<j>`, by messages_input.py.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from engine.sample.sampling_params import INT64_LIMIT, MAX_STOP_STRINGS
from engine.entrypoints.openai.protocol import RequestBody, StopText, StructuredOutputsField, Text, _Request, null_is


class AnthropicMessage(_Request):
    role: Literal["user", "assistant", "system"]  # system turns anywhere (Claude Code sends them mid-conversation)
    content: Text | list[dict[str, Any]]


class ThinkingConfig(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0, lt=INT64_LIMIT)  # the template decides; max_tokens bounds it
    display: Text | None = None


class OutputFormat(_Request):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(_Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(RequestBody):
    model: Text | None = None
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: Text | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # a caching hint; every prefix is cached anyway
    speed: Literal["standard", "fast"] | None = None  # one speed
    user_profile_id: Text | None = None
    workspace_id: Text | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    # Claude Code's server-side clearing of old tool results: accepted without effect (the whole conversation
    # is rendered; a prompt that does not fit is a 400 naming max_tokens or messages)
    context_management: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1, lt=INT64_LIMIT)
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: Annotated[bool, null_is(False)] = False
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=INT64_LIMIT)
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: Text | None = None
    # vLLM-style extras (extra_body): a seed, and an output constraint of vLLM's structured_outputs
    seed: int | None = Field(None, ge=-1, lt=2**63)
    structured_outputs: StructuredOutputsField | None = None
