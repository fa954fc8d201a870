"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras), as pydantic models.

Field ranges are declared from SamplingParams' own limits, so /openapi.json documents them and a
client gets a 400 naming the field; SamplingParams checks them again for the offline API. Every integer
is bounded to int64 and every list the engine walks per step is bounded in length, so no value can overflow
a tensor or stall a step after admission. Every text
field rejects lone UTF-16 surrogates, and floats reject NaN and infinity, so nothing malformed
reaches the tokenizer or the sampler. Types are strict, as OpenAI's and Anthropic's are: a boolean is true or
false (not "yes"), an integer is a JSON integer (not true, not "5", not 5.0), a number is not a string.
Every list stops at its first invalid item, so a body of a million wrong items costs one error, not a
million (it once held the event loop for seconds). A field outside both APIs, at any depth, is accepted and
ignored (as vLLM does; ignored_fields.py names it in a response header, and --strict-request-fields makes it a
400); fields of the APIs we do not implement are declared from `refusals.REFUSALS` and refused by value.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, GetCoreSchemaHandler, StrictInt,
                      create_model, model_validator)
from pydantic_core import CoreSchema

from engine.sample.sampling_params import (INT64_LIMIT, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                                    MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                    MAX_STOP_TOKEN_IDS)
from engine.entrypoints.openai.ignored_fields import report_unknown
from engine.entrypoints.openai.refusals import REFUSALS


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text holds a lone UTF-16 surrogate at position {exc.start}; send valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
# Strict: true/false and "5" are not token ids; int64 at most, so no id overflows a tensor before the vocabulary check.
TokenId = Annotated[StrictInt, Field(ge=0, lt=INT64_LIMIT)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# Length limits sit on the str itself (before the Unicode check), so errors say "characters", not "items".
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,12}$")]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS), AfterValidator(_valid_unicode)]


def null_is(default: Any) -> BeforeValidator:
    """OpenAI's schema lets clients send an explicit null for some fields (n, stream, logprobs, echo): it means the
    default."""
    return BeforeValidator(lambda v: default if v is None else v)


def _lists_fail_fast(schema: CoreSchema) -> None:
    """Every list in a core schema stops validating at its first invalid item."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "list":
                node["fail_fast"] = True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


class _Request(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="allow", strict=True)
    report_extra: ClassVar[bool] = True  # unknown keys are ignored fields (not a content part's payload)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        schema = handler(source)
        _lists_fail_fast(schema)
        return schema


class RequestBody(_Request):
    """A route's whole body: once validated, its unknown fields at every depth are reported and dropped."""

    @model_validator(mode="after")
    def _report_unknown_fields(self) -> "RequestBody":
        report_unknown(self)
        return self


# OpenAI's limits on metadata: at most 16 pairs, keys of at most 64 characters, string values of at most 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
Metadata = Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS), AfterValidator(_valid_unicode)],
                          Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS), AfterValidator(_valid_unicode)]],
                     Field(max_length=MAX_METADATA_PAIRS)]
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage so far in every chunk
    include_obfuscation: bool | None = None  # OpenAI pads streamed chunks against side channels; loopback: no effect


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(populate_by_name=True)
    name: Text = Field("response", max_length=64)
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class StructureFormat(_Request):
    """One tag of vLLM's structural_tag response format: JSON matching `schema` between begin and end."""
    begin: Text
    structure_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    end: Text
    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[StructureFormat] | None = None  # structural_tag, vLLM's form (with triggers)
    triggers: list[Text] | None = None
    format: dict[str, Any] | None = None  # structural_tag, xgrammar's form


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` object (one constraint kind)."""
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    structural_tag: dict[str, Any] | Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON is generated compact either way
    disable_fallback: bool = False  # one grammar engine: nothing to fall back to
    disable_additional_properties: bool = False  # xgrammar's strict mode already forbids them
    # An option of an output constraint we do not know would change the output if dropped: a 400, as vLLM's
    # StructuredOutputsParams (a dataclass) refuses it, whatever --strict-request-fields says.
    model_config = ConfigDict(populate_by_name=True, extra="forbid")


RefusableFields = create_model("RefusableFields", __base__=RequestBody,
                               **{r.field: (Any, r.default) for r in REFUSALS if "." not in r.field})


class SamplingFields(RefusableFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = Field(None, description="Served model name; default: the one model served")
    n: Annotated[int, null_is(1)] = Field(1, ge=1, le=MAX_N, description="Choices per prompt")
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=INT64_LIMIT, description="-1 or 0: off; above the vocabulary "
                                                                        "size: the whole vocabulary")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    seed: int | None = Field(None, ge=-1, lt=2**63, description="-1: random, as no seed")
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=INT64_LIMIT)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="Token id (as a string) → bias added to its logit")
    stream: Annotated[bool, null_is(False)] = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    metadata: Metadata | None = None  # accepted; nothing is stored
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None  # a routing hint; the prefix cache is automatic
    prompt_cache_options: dict[str, Any] | None = None  # OpenAI's explicit breakpoints; every prefix is cached anyway
    store: bool | None = None  # accepted; nothing is stored (there is no stored-completions API)
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted without effect: no model reads it
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structural_tag: Text | None = Field(None, description="vLLM: a structural tag as JSON text")
    structured_outputs: StructuredOutputsField | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top logprobs per prompt token")
    return_token_ids: bool | None = Field(None, description="vLLM: prompt and generated token ids in the reply")
    request_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")] | None = Field(
        None, description="vLLM: the response id is cmpl-/chatcmpl- + this (must not be in use)")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[Text] | None = Field(None, max_length=MAX_BAD_WORDS, description="vLLM: words never to generate")
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM: logprob tokens as 'token_id:N'")
    priority: int = Field(0, ge=-2**31, lt=2**31, description="vLLM: with --scheduling-policy priority, lower "
                                                                "values are served first")
    use_beam_search: bool = Field(False, description="vLLM: beam search of width n; the n best beams are the choices")
    length_penalty: float | None = Field(None, description="vLLM: beams rank by cumulative logprob / length^this")
    cache_salt: NonEmptyText | None = Field(None, description="vLLM: only requests with the same salt share "
                                                              "cached prompt prefixes")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, lt=INT64_LIMIT,
                                               description="Keep the last k prompt tokens; -1: max_model_len")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="vLLM: with truncate_prompt_tokens, cut the prompt's start (left, default) or end (right)")


class CompletionRequest(SamplingFields):
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)] = Field(
        ..., description="A string, a list of strings, token ids, or a list of token-id lists (none empty)")
    max_tokens: int | None = Field(16, ge=0, lt=INT64_LIMIT,
                                   description="0 only with echo: score the prompt, generate nothing")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top logprobs per token")
    echo: Annotated[bool, null_is(False)] = False
    add_special_tokens: bool = True


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition
    cache_control: dict[str, Any] | None = None  # Anthropic-style cache hint (litellm sends it); caching is automatic


class FunctionName(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class TextPart(_Request):
    model_config = ConfigDict(extra="allow")
    report_extra: ClassVar[bool] = False  # image_url, input_audio ...: the part's payload, refused by its type
    type: Literal["text", "image_url", "input_audio", "video_url", "audio_url", "file", "refusal"]
    text: Text | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None
    reasoning: Text | None = None
    refusal: Text | None = None
    # What the SDK's own response message carries (`message.model_dump()` sent back): accepted and ignored.
    annotations: list[dict[str, Any]] | None = None
    audio: None = None  # a reference to generated audio; there is none
    function_call: None = None  # deprecated; send tool_calls


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=INT64_LIMIT,
                                   description="Deprecated by OpenAI; max_completion_tokens wins")
    max_completion_tokens: int | None = Field(None, ge=1, lt=INT64_LIMIT)
    logprobs: Annotated[bool, null_is(False)] = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="With logprobs=true: top alternatives per token")
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: Annotated[bool, null_is(False)] = False
    add_special_tokens: bool = Field(False, description="vLLM: add the tokenizer's BOS etc. on top of the template's")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Passed to the chat template as reasoning_effort / enable_thinking where it reads them")


class TokenizeRequest(RequestBody):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: Text | None = None
    tokens: list[TokenId]
