"""POST /v1/messages and /v1/messages/count_tokens through the real anthropic SDK (plain, streamed with the
SDK's stream helper, a tool_use / tool_result round trip, stop sequences, count_tokens, x-api-key, errors in
Anthropic's shape) against a real uvicorn server on a tiny random model with a hermes-style template and
the qwen3 reasoning parser; grammars (forced tool_choice, vLLM's guided_regex extra) fix the output's shape."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from server_harness import AGENT_API_KEY as KEY, MODEL_NAME
TIME_TOOL = {"name": "get_time", "description": "The time in a zone", "input_schema": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}
USER = [{"role": "user", "content": "What time is it?"}]
GREEDY = {"temperature": 0}  # this SDK version dropped the sampling arguments; the API still takes them
RAW = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
       "message_stop"}


@pytest.fixture(scope="module")
def server(agent_api_server):
    return agent_api_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_plain_message(client):
    m = client.messages.create(model=MODEL_NAME, max_tokens=6, messages=USER, system="Be brief.", extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6 and m.usage.input_tokens > 0
    assert [b.type for b in m.content] == ["text"]


def test_stream_matches_and_thinking_blocks(client):
    kw = dict(model=MODEL_NAME, max_tokens=40, messages=USER, system=[{"type": "text", "text": "Think first."}],
              extra_body={**GREEDY, "structured_outputs": {"regex": "<think>[a-z]{1,6}</think>Yes\\."}})
    whole = client.messages.create(**kw)
    assert [b.type for b in whole.content] == ["thinking", "text"] and whole.content[1].text == "Yes."
    assert whole.stop_reason == "end_turn" and 1 <= len(whole.content[0].thinking) <= 6
    kinds = []
    with client.messages.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.stop_reason == "end_turn" and streamed.usage.output_tokens == whole.usage.output_tokens
    raw = [k for k in kinds if k in RAW]  # the SDK adds derived events (text, thinking) between the raw ones
    raw = [k for i, k in enumerate(raw) if i == 0 or k != raw[i - 1]]
    assert raw == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                   "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                   "message_stop"]
    plain = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=USER, extra_body=GREEDY)
    with client.messages.stream(model=MODEL_NAME, max_tokens=8, messages=USER, extra_body=GREEDY) as stream:
        assert stream.get_final_text() == plain.content[0].text


def test_tool_use_round_trip_streamed_and_not(client):
    kw = dict(model=MODEL_NAME, max_tokens=60, messages=USER, tools=[TIME_TOOL], extra_body=GREEDY,
              tool_choice={"type": "tool", "name": "get_time"})
    m = client.messages.create(**kw)
    [use] = m.content
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_time"
    assert use.id.startswith("toolu_") and use.input["zone"] in ("utc", "cet")
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"
    anyone = client.messages.create(**{**kw, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert [b.type for b in anyone.content] == ["tool_use"]
    follow = client.messages.create(model=MODEL_NAME, max_tokens=4, tools=[TIME_TOOL], extra_body=GREEDY,
                                    messages=[
        *USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12:00"},
                                     {"type": "text", "text": "Thanks."}]}])
    def prompt(u) -> int:  # Anthropic counts cached prompt tokens apart
        return u.input_tokens + u.cache_read_input_tokens

    assert follow.stop_reason == "max_tokens" and prompt(follow.usage) > prompt(m.usage)


def test_count_tokens_matches_the_prompt(client):
    kw = dict(model=MODEL_NAME, messages=USER, tools=[TIME_TOOL], system="Be brief.")
    counted = client.messages.count_tokens(**kw).input_tokens
    m = client.messages.create(max_tokens=1, **kw)
    assert counted == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0


def test_x_api_key_and_anthropic_error_shape(server):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": USER}
    ok = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    denied = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=60)
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert denied.json()["type"] == "error"
    for bad, words in [({**body, "max_tokens": None}, "max_tokens"),
                       ({**body, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
                       ({**body, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                        "image")]:
        r = httpx.post(server.url + "/v1/messages", json={k: v for k, v in bad.items() if v is not None},
                       headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        assert words in r.json()["error"]["message"], r.json()


def test_sdk_raises_on_a_bad_request(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL_NAME, max_tokens=10**6, messages=USER)
    assert err.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in str(err.value)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=2, messages=USER)
