"""Forced tool calls on a model whose chat template has no tool section (the tiny default template): tools go in a
system preamble we render, the grammar holds the call's shape, `auto` stays a 400."""
from __future__ import annotations

import json

import openai
import pytest

from server_harness import MODEL_NAME, start_server

USER = [{"role": "user", "content": "Time?"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}},
    {"type": "function", "function": {"name": "ping"}}]


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir, max_model_len=512)
    assert not srv.app.state.ctx.served_model().supports_tools
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def _prompt_text(server, response) -> str:
    return server.app.state.ctx.served_model().tokenizer.decode(response.prompt_token_ids)


def _check(call) -> None:
    args = json.loads(call.function.arguments)
    assert (call.function.name, args) in (("ping", {}), ("get_time", {"zone": "utc"}), ("get_time", {"zone": "cet"}))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_calls_validate(server, client, temperature):
    kw = dict(model=MODEL_NAME, messages=USER, tools=TOOLS, temperature=temperature, seed=2, max_tokens=60,
              parallel_tool_calls=False, extra_body={"return_token_ids": True})
    r = client.chat.completions.create(tool_choice="required", **kw)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    [call] = r.choices[0].message.tool_calls
    _check(call)
    text = _prompt_text(server, r)
    assert text.startswith("<|im_start|>system\nYou have these functions") and '"name": "get_time"' in text
    assert "JSON list of calls" in text
    r = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    _check(call)
    assert "Call the function 'get_time'" in _prompt_text(server, r)


def test_streamed_forced_call_and_client_system_message(server, client):
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=60,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            stream=True)
    args, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            args += "".join(d.function.arguments or "" for d in c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and json.loads(args)["zone"] in ("utc", "cet")
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=60,
                                       tool_choice="required", extra_body={"return_token_ids": True})
    text = _prompt_text(server, r)
    assert text.count("<|im_start|>system") == 1 and "You have these functions" in text and "Be brief." in text


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_on_such_a_template_stays_a_clear_400(client, choice):
    kw = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=5, **kw)
    body = err.value.body
    assert body["param"] == (choice or "tools").replace("auto", "tool_choice"), body
    assert "no tool section" in body["message"] and "'required' or a named function" in body["message"]
