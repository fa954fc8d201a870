"""Tools, reasoning and structured outputs as real clients use them: the openai SDK (tool_choice required /
named / auto, streamed and not, tool results round-tripping through the template), instructor (TOOLS and
JSON_SCHEMA modes) and LangChain (with_structured_output, bind_tools), against a tiny random model with a
hermes-style chat template, and litellm (the OpenAI-compatible provider: chat, streaming, tools, text
completions). Grammars make even a random model's calls validate."""
from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from server_harness import MODEL_NAME, start_server
from tiny_models import TOOL_CHAT_TEMPLATE

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(BaseModel):
    """Weather in a city."""

    city: str = Field(max_length=6)
    unit: Literal["c", "f"]
    days: int = Field(ge=1, le=7)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": Weather.model_json_schema()}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
FORCED_HERMES = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # Tool definitions take a few hundred tokens of the tiny vocabulary: a longer context than the default.
    path = tiny_model_dir("qwen2", chat_template=TOOL_CHAT_TEMPLATE, max_position_embeddings=1024)
    srv = start_server(path, max_model_len=1024)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def _validate(call) -> None:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        Weather.model_validate(args)
    else:
        assert call.function.name == "get_time" and args["zone"] in ("utc", "cet")


def _collect_stream(stream) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                assert d.id in (None, call["id"]) and d.function.name in (None, call["name"])
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("temperature, n", [(0.0, 1), (1.0, 2)])
def test_tool_choice_required_calls_validate(client, temperature, n):
    # One call per choice: a random model would otherwise keep appending calls until max_tokens.
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="required",
                                       temperature=temperature, max_tokens=120, n=n, seed=4,
                                       parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls and all(c.id.startswith("call_") for c in choice.message.tool_calls)
        for call in choice.message.tool_calls:
            _validate(call)


def test_named_tool_choice_streamed_and_not(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=choice,
                                       temperature=1.0, max_tokens=80, seed=7)
    [call] = r.choices[0].message.tool_calls
    _validate(call)
    content, calls, finish = _collect_stream(client.chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=choice, temperature=1.0, max_tokens=80, seed=7,
        stream=True))
    assert content == "" and finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    content, calls, finish = _collect_stream(client.chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=120, stream=True,
        parallel_tool_calls=False))
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["id"].startswith("call_")


def test_auto_tool_choice_parses_hermes_calls(client):
    """The hermes parser (detected from the template) reads a call the model wrote as text; without
    tool_choice, tools mean auto."""
    kwargs = dict(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=150, temperature=0,
                  extra_body={"guided_regex": r"Sure\." + FORCED_HERMES})
    r = client.chat.completions.create(tool_choice="auto", **kwargs)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Sure."
    [call] = message.tool_calls
    _validate(call)
    content, calls, finish = _collect_stream(client.chat.completions.create(stream=True, **kwargs))
    assert content == "Sure." and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_tool_results_round_trip_through_the_template(client):
    first = client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, parallel_tool_calls=False)
    assistant = first.choices[0].message
    messages = USER + [assistant.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in assistant.tool_calls]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=3)
    assert r.choices[0].finish_reason == "length"


def test_reasoning_content_split(server, client, monkeypatch):
    monkeypatch.setattr(server.app.state.ctx.served_model(), "reasoning_parser", "qwen3")
    kwargs = dict(model=MODEL_NAME, messages=USER, max_tokens=40, temperature=0,
                  extra_body={"guided_regex": "<think>[a-z]{1,6}</think>Yes"})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.content == "Yes" and 1 <= len(message.reasoning_content) <= 6
    assert message.reasoning == message.reasoning_content  # vLLM's newer name, sent as well
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            assert getattr(c.delta, "reasoning", None) == getattr(c.delta, "reasoning_content", None)
            content += c.delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, "Yes")


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_a_validated_object(client, mode):
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    weather = patched.chat.completions.create(model=MODEL_NAME, messages=USER, response_model=Weather,
                                              max_tokens=80, max_retries=0)
    assert isinstance(weather, Weather)


def test_langchain_structured_output_and_bind_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL_NAME, base_url=server.base_url, api_key="none", max_tokens=80,
                                      temperature=0, max_retries=0)
    for method in ("json_schema", "function_calling"):
        result = llm.with_structured_output(Weather, method=method).invoke("Weather in Paris?")
        assert isinstance(result, Weather), method
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "Weather" and Weather.model_validate(call["args"])


@pytest.mark.filterwarnings("ignore::UserWarning:pydantic")  # litellm's own TypedDicts, not ours
def test_litellm_chat_stream_tools_and_text_completion(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else litellm fetches its price list online
    litellm = pytest.importorskip("litellm")
    litellm.telemetry = False
    kw = dict(model=f"openai/{MODEL_NAME}", api_base=server.base_url, api_key="none", temperature=0)
    reply = litellm.completion(messages=USER, max_tokens=8, **kw)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       litellm.completion(messages=USER, max_tokens=8, stream=True, **kw))
    assert streamed == reply.choices[0].message.content  # greedy: the same text, streamed
    forced = litellm.completion(messages=USER, tools=TOOLS, max_tokens=80,
                                tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw)
    [call] = forced.choices[0].message.tool_calls
    _validate(call)
    text = litellm.text_completion(prompt="The weather in Paris is", max_tokens=5, **kw)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 5


ORDERED = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 12},
                                            "answer": {"type": "integer", "minimum": 0, "maximum": 99}},
           "required": ["reasoning", "answer"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_key_order_is_kept(client, temperature):
    """`reasoning` before `answer`, as the client wrote them (not alphabetical), in response_format and in forced
    tool arguments (named and required); the reverse order of the same schema comes back reversed."""
    def keys(text: str) -> list[str]:
        return list(json.loads(text))

    kw = dict(model=MODEL_NAME, messages=USER, max_tokens=150, temperature=temperature, seed=4)
    fmt = {"type": "json_schema", "json_schema": {"name": "cot", "schema": ORDERED}}
    r = client.chat.completions.create(response_format=fmt, n=2, **kw)
    assert all(keys(c.message.content) == ["reasoning", "answer"] for c in r.choices)
    reverse = dict(ORDERED, properties=dict(reversed(ORDERED["properties"].items())))
    r = client.chat.completions.create(response_format={"type": "json_schema",
                                                        "json_schema": {"name": "cot", "schema": reverse}}, **kw)
    assert keys(r.choices[0].message.content) == ["answer", "reasoning"]
    tools = [{"type": "function", "function": {"name": "solve", "parameters": ORDERED}}]
    for choice in ("required", {"type": "function", "function": {"name": "solve"}}):
        r = client.chat.completions.create(tools=tools, tool_choice=choice, parallel_tool_calls=False, **kw)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "solve" and keys(call.function.arguments) == ["reasoning", "answer"]
