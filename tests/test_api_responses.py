"""POST /v1/responses through the real openai SDK (`responses.create`, `responses.stream`, a function-call round
trip, text.format structured output, previous_response_id chaining, retrieve/delete) and the openai-agents SDK's
default model (OpenAIResponsesModel) running an agent with one function tool, against a real uvicorn server
on a tiny random model with a hermes-style template and the qwen3 reasoning parser. Grammars (vLLM's
structured_outputs extra, or forced tools) make the random model's output known in shape."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from server_harness import AGENT_API_KEY as API_KEY, MODEL_NAME

TIME_TOOL = {"type": "function", "name": "get_time", "description": "The time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}
THINK_THEN_ANSWER = {"regex": "<think>[a-z]{1,6}</think>Yes\\."}


@pytest.fixture(scope="module")
def server(agent_api_server):
    return agent_api_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def test_plain_string_input(client):
    r = client.responses.create(model=MODEL_NAME, input="Hello there", max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_NAME
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_reasoning_item_and_stream_events_agree(client):
    kw = dict(model=MODEL_NAME, input=[{"role": "user", "content": [{"type": "input_text", "text": "Sure?"}]}],
              instructions="Answer briefly.", max_output_tokens=40, temperature=0, reasoning={"effort": "low"},
              extra_body={"structured_outputs": THINK_THEN_ANSWER})
    r = client.responses.create(**kw)
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "message"]
    reasoning = r.output[0].content[0].text
    assert 1 <= len(reasoning) <= 6 and r.output_text == "Yes."
    assert 1 <= r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    kinds, text, reasoning_streamed = [], "", ""
    with client.responses.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
            text += event.delta if event.type == "response.output_text.delta" else ""
            reasoning_streamed += event.delta if event.type == "response.reasoning_text.delta" else ""
        final = stream.get_final_response()
    assert (reasoning_streamed, text) == (reasoning, "Yes.") and final.output_text == "Yes."
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.completed"
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert squeezed[2:] == ["response.output_item.added", "response.content_part.added",
                            "response.reasoning_text.delta", "response.reasoning_text.done",
                            "response.content_part.done", "response.output_item.done",
                            "response.output_item.added", "response.content_part.added",
                            "response.output_text.delta", "response.output_text.done",
                            "response.content_part.done", "response.output_item.done", "response.completed"]


def test_function_call_round_trip_streamed_and_not(client):
    kw = dict(model=MODEL_NAME, input="What time is it?", tools=[TIME_TOOL], tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    r = client.responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["zone"] in ("utc", "cet") and r.status == "completed"
    deltas, done = "", None
    with client.responses.stream(**kw) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                deltas += event.delta
            elif event.type == "response.function_call_arguments.done":
                done = event
    assert done.name == "get_time" and deltas == done.arguments == call.arguments
    follow = client.responses.create(model=MODEL_NAME, tools=[TIME_TOOL], max_output_tokens=4, temperature=0,
                                     input=[{"role": "user", "content": "What time is it?"},
                                            call.model_dump(exclude_none=True),
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "12:00"}])
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens


def test_named_tool_choice_and_auto_parse(client):
    r = client.responses.create(model=MODEL_NAME, input="Time?", tools=[TIME_TOOL], max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_time"}, temperature=1.0,
                                extra_body={"seed": 3})
    assert [o.type for o in r.output] == ["function_call"] and r.output[0].name == "get_time"
    forced_text = {"regex": 'Ok\\.<tool_call>\\{"name": "get_time", "arguments": \\{"zone": "utc"\\}\\}</tool_call>'}
    r = client.responses.create(model=MODEL_NAME, input="Time?", tools=[TIME_TOOL], max_output_tokens=150,
                                temperature=0, extra_body={"structured_outputs": forced_text})
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == "Ok."
    assert json.loads(r.output[1].arguments) == {"zone": "utc"}


def test_text_format_json_schema_keeps_key_order(client):
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 8},
                                               "answer": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    r = client.responses.create(model=MODEL_NAME, input="2+2?", max_output_tokens=80, temperature=0,
                                text={"format": {"type": "json_schema", "name": "cot", "schema": schema,
                                                 "strict": True}})
    assert list(json.loads(r.output_text)) == ["reasoning", "answer"]
    assert r.text.format.type == "json_schema"


def test_previous_response_id_chains_and_store_false_is_not_kept(client):
    first = client.responses.create(model=MODEL_NAME, input="My name is Ada.", max_output_tokens=3, temperature=0)
    second = client.responses.create(model=MODEL_NAME, input="What is my name?", max_output_tokens=3,
                                     temperature=0, previous_response_id=first.id)
    alone = client.responses.create(model=MODEL_NAME, input="What is my name?", max_output_tokens=3, temperature=0,
                                    store=False)
    assert second.previous_response_id == first.id and second.usage.input_tokens > alone.usage.input_tokens
    assert client.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id=alone.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_refusals_name_the_field(client):
    cases = [(dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
              "input.0.content.0"),
             (dict(input="x", background=True), "background"),
             (dict(input="x", max_output_tokens=10**6), "max_output_tokens")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL_NAME, **kwargs)
        assert err.value.body["param"] == param, (kwargs, err.value.body)


class Clock(BaseModel):
    hour: int = Field(ge=0, le=23)


def test_openai_agents_default_model_runs_a_function_tool(server):
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a zone."""
        calls.append(zone)
        return "12:00"

    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=openai.AsyncOpenAI(
        base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120))
    # A structured output type makes the random model's final turn end (the grammar closes the JSON), as a
    # plain-text turn would run to max_tokens, which the SDK treats as a failed run.
    agent = agents.Agent(name="clock", instructions="Tell the time.", tools=[get_time], model=model,
                         output_type=Clock, model_settings=agents.ModelSettings(tool_choice="get_time",
                                                                                 max_tokens=60, temperature=0))
    result = asyncio.run(agents.Runner.run(agent, "What time is it in UTC?", max_turns=3))
    assert calls in (["utc"], ["cet"])  # the forced first turn; tool_choice then resets to auto
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert isinstance(result.final_output, Clock)


def test_qwen3_coder_calls_are_typed_by_the_request_schema(server, client, monkeypatch):
    """The qwen3_coder parser on the server path: the model writes the XML-style call as text (forced by a
    regex here) and the reply holds a function_call whose arguments are typed by the tool's schema."""
    monkeypatch.setattr(server.app.state.ctx.served_model(), "tool_parser", "qwen3_coder")
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"zip": {"type": "string"}, "days": {"type": "integer"}}}}
    xml = ("<tool_call>\\n<function=get_weather>\\n<parameter=zip>\\n75001\\n</parameter>\\n<parameter=days>\\n3\\n"
           "</parameter>\\n</function>\\n</tool_call>")
    r = client.responses.create(model=MODEL_NAME, input="Weather?", tools=[tool], max_output_tokens=200,
                                temperature=0, extra_body={"structured_outputs": {"regex": xml}})
    [call] = r.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"zip": "75001", "days": 3}


def test_harmony_reply_on_the_server_path(server, client, monkeypatch):
    """gpt-oss's harmony parsers on the server path (the tiny tokenizer spells the markers as plain text, which
    the regex writes): the analysis channel comes back as a reasoning item, the call as a function_call."""
    model = server.app.state.ctx.served_model()
    monkeypatch.setattr(model, "tool_parser", "openai")
    monkeypatch.setattr(model, "reasoning_parser", "openai_gptoss")
    harmony = ('<\\|channel\\|>analysis<\\|message\\|>[a-z]{1,5}<\\|end\\|><\\|start\\|>assistant to=functions\\.'
               'get_time<\\|channel\\|>commentary json<\\|message\\|>\\{"zone": "cet"\\}<\\|call\\|>')
    kw = dict(model=MODEL_NAME, input="Time?", tools=[TIME_TOOL], max_output_tokens=200, temperature=0,
              extra_body={"structured_outputs": {"regex": harmony}})
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert 1 <= len(r.output[0].content[0].text) <= 5 and r.output[1].name == "get_time"
    assert json.loads(r.output[1].arguments) == {"zone": "cet"}
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    fresh = {"id", "call_id", "parsed_arguments"}  # new ids per reply; the stream helper adds parsed_arguments
    assert [o.model_dump(exclude=fresh) for o in final.output] == [o.model_dump(exclude=fresh) for o in r.output]


def test_response_store_is_bounded_lru():
    from engine.entrypoints.openai.responses_store import ResponseStore, StoredResponse

    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # "a" is now the most recent: "b" goes first
    store.put("c", StoredResponse({"id": "c"}, []))
    assert len(store) == 2 and store.get("b") is None and store.get("a") and store.get("c")
    assert store.delete("a") and not store.delete("a")
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(capacity=0)


def test_response_store_is_bounded_by_bytes():
    """Issue 34: 256 stored responses of 4 MiB bodies once held 6-11 GiB. The store holds compact JSON and drops
    the least recently used past its byte bound too; one larger than the bound alone is not kept."""
    from engine.entrypoints.openai.responses_store import ResponseStore, StoredResponse

    store = ResponseStore(capacity=100, max_bytes=10_000)
    tools = [{"type": "function", "name": "t", "description": "d" * 3000}]
    for i in range(10):
        assert store.put(f"r{i}", StoredResponse({"id": f"r{i}", "tools": tools}, [{"role": "user", "content": "hi"}]))
        assert store.num_bytes <= store.max_bytes
    assert len(store) == 3 and store.get("r0") is None
    kept = store.get("r9")
    assert kept.response == {"id": "r9", "tools": tools} and kept.conversation == [{"role": "user", "content": "hi"}]
    assert not store.put("huge", StoredResponse({"id": "huge", "x": "y" * 20_000}, [])) and store.get("huge") is None
    before = store.num_bytes
    assert store.delete("r9") and store.num_bytes == before - kept.num_bytes


def test_metadata_has_openais_limits(client):
    """16 pairs at most, keys of at most 64 characters, string values of at most 512 (as OpenAI)."""
    ok = {f"k{i}": "v" * 512 for i in range(16)}
    r = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=1, metadata=ok)
    assert r.metadata == ok
    for bad in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}):
        with pytest.raises(openai.BadRequestError, match="metadata"):
            client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=1, metadata=bad)
        with pytest.raises(openai.BadRequestError, match="metadata"):
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=1, metadata=bad)
