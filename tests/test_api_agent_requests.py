"""The request shapes the agent CLIs send, over HTTP against real servers, without the CLIs themselves.

Claude Code's first /v1/messages request (a system turn inside `messages`, adaptive thinking, output_config,
context_management, metadata, a tool with defer_loading), with the system turn kept in place or folded into the
system prompt by what the template takes; message_start's usage showing cache reads; Codex's /v1/responses request
(client_metadata, a namespace tool, a hosted web_search tool ignored and named in x-pagedesk-ignored-fields) and a
namespaced call coming back with its namespace; /v1/responses/compact and its compaction item sent back; forced
tool calls whose schema uses $defs/$ref (pydantic models with nested models) on chat, responses and messages; and
the smaller fields (truncation_side, logprob_token_ids, stop_reason for EOS).
"""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from engine.entrypoints.openai.messages_input import chat_messages
from engine.entrypoints.openai.prompts import renders_system_anywhere
from engine.entrypoints.openai.protocol_messages import MessagesRequest
from server_harness import AGENT_API_KEY as KEY, MODEL_NAME
from tiny_models import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE, _tokenizer

USER = [{"role": "user", "content": "What time is it?"}]
AUTH = {"Authorization": f"Bearer {KEY}"}


class Address(BaseModel):  # enums keep a random model's arguments short
    city: Literal["Paris", "Rome"]


class Person(BaseModel):
    name: Literal["Ada"]
    home: Address


def claude_first_request(system_turn: str) -> dict:
    """Claude Code 2.1's first request, cut down (its real one has 24 tools and 40k characters)."""
    return {"model": MODEL_NAME, "max_tokens": 4, "stream": False,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
                       {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"},
                                                      {"type": "text", "text": "hello"}]},
                         {"role": "system", "content": [{"type": "text", "text": system_turn}]}],
            "tools": [{"name": "Read", "description": "Read a file", "input_schema": {
                "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
                {"name": "DeferredToolPlaceholder", "description": "x", "defer_loading": True,
                 "input_schema": {"type": "object", "properties": {}}}],
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}}


def test_claude_codes_first_request_is_answered(agent_api_server):
    r = httpx.post(agent_api_server.url + "/v1/messages", json=claude_first_request("# Environment\ncwd: /w"),
                   headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and "x-pagedesk-ignored-fields" not in r.headers


def test_system_turns_stay_in_place_or_join_the_system_prompt():
    req = MessagesRequest.model_validate(claude_first_request("ENV"))
    in_place = chat_messages(req, system_in_place=True)
    assert [m["role"] for m in in_place] == ["system", "user", "system"] and in_place[2]["content"] == "ENV"
    merged = chat_messages(req, system_in_place=False)
    assert [m["role"] for m in merged] == ["system", "user"]
    assert merged[0]["content"].endswith("You are a coding agent.\n\nENV")
    tokenizer = copy.deepcopy(_tokenizer())
    first_only = "{{ messages[0]['content'] }}{% for m in messages[1:] %}{% if m['role'] == 'system' %}" \
                 "{{ raise_exception('System role must come first') }}{% endif %}{{ m['content'] }}{% endfor %}"
    for template, takes in ((TOOL_CHAT_TEMPLATE, True), (CHAT_TEMPLATE, True), (first_only, False),
                            ("{% for m in messages if m['role'] != 'system' %}{{ m['content'] }}{% endfor %}", False)):
        tokenizer.chat_template = template
        model = SimpleNamespace(tokenizer=tokenizer, system_anywhere=None)
        assert renders_system_anywhere(model) is takes, template


def test_message_start_shows_cache_reads(agent_api_server):
    body = {**claude_first_request("cache " * 40), "stream": True}
    for _ in range(2):  # the second request reads the first one's prefix from the cache
        with httpx.stream("POST", agent_api_server.url + "/v1/messages", json=body, headers=AUTH, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    start = events[0]["message"]["usage"]
    final = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert events[0]["type"] == "message_start" and start["cache_read_input_tokens"] > 0
    assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"]
    assert start["input_tokens"] == final["input_tokens"]


NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Spawn one", "strict": False, "parameters": {
        "type": "object", "properties": {"message": {"type": "string", "enum": ["go"]}}, "required": ["message"],
        "additionalProperties": False}}]}
EXEC = {"type": "function", "name": "exec_command", "description": "Run", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


def codex_request(**overrides) -> dict:
    body = {"model": MODEL_NAME, "stream": False, "max_output_tokens": 4, "store": False,
            "input": [{"type": "message", "id": "msg_1", "role": "developer",
                       "content": [{"type": "input_text", "text": "You are Codex."}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
            "tools": [EXEC, NAMESPACE, {"type": "web_search", "external_web_access": False}],
            "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s1",
            "client_metadata": {"turn_id": "t1", "x-codex-turn-metadata": "{}"}}
    return {**body, **overrides}


def test_codex_request_is_answered_and_the_hosted_tool_named(agent_api_server):
    r = httpx.post(agent_api_server.base_url + "/responses", json=codex_request(), headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-pagedesk-ignored-fields"] == "tools.2.type"
    names = [t["name"] for t in r.json()["tools"]]
    assert names == ["exec_command", "spawn_agent"] and r.json()["tools"][1]["namespace"] == "multi_agent_v1"


def test_a_namespaced_call_comes_back_with_its_namespace(agent_api_server):
    choice = {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}
    r = httpx.post(agent_api_server.base_url + "/responses", headers=AUTH, timeout=120,
                   json=codex_request(tool_choice=choice, max_output_tokens=40))
    assert r.status_code == 200, r.text
    [call] = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert (call["name"], call["namespace"], json.loads(call["arguments"])) == ("spawn_agent", "multi_agent_v1",
                                                                                {"message": "go"})
    replay = codex_request(input=codex_request()["input"] + [
        {"type": "function_call", "call_id": call["call_id"], "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "started"}])
    r = httpx.post(agent_api_server.base_url + "/responses", json=replay, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text


def test_compact_then_continue(agent_api_server):
    body = {"model": MODEL_NAME, "instructions": "You are Codex.",
            "input": [{"type": "message", "role": "user", "content": "Fix the bug in parser.py"},
                      {"type": "message", "role": "assistant", "content": "Done: an off-by-one in line 3."}]}
    r = httpx.post(agent_api_server.base_url + "/responses/compact", json=body, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    compacted = r.json()
    assert compacted["object"] == "response.compaction" and compacted["usage"]["input_tokens"] > 0
    kinds = [item["type"] for item in compacted["output"]]
    assert kinds == ["message", "compaction"] and compacted["output"][0]["content"][0]["text"].startswith("Fix")
    follow = {"model": MODEL_NAME, "max_output_tokens": 2,
              "input": compacted["output"] + [{"type": "message", "role": "user", "content": "And now?"}]}
    r = httpx.post(agent_api_server.base_url + "/responses", json=follow, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text


def test_forced_tools_with_defs_on_all_three_apis(agent_api_server):
    schema = Person.model_json_schema()
    assert "$defs" in schema and "$ref" in json.dumps(schema["properties"])
    other = {"type": "object", "properties": {"zone": {"enum": ["utc"]}}, "required": ["zone"]}
    client = openai.OpenAI(base_url=agent_api_server.base_url, api_key=KEY, max_retries=0, timeout=300)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=120, tool_choice="required", parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "add_person", "parameters": schema}},
               {"type": "function", "function": {"name": "get_time", "parameters": other}}])
    calls = chat.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("add_person", "get_time") for c in calls), chat
    response = client.responses.create(
        model=MODEL_NAME, input="Add Ada", max_output_tokens=120, tool_choice="required", parallel_tool_calls=False,
        tools=[{"type": "function", "name": "add_person", "parameters": schema},
               {"type": "function", "name": "get_time", "parameters": other}])
    assert any(item.type == "function_call" for item in response.output), response.output
    messages = anthropic.Anthropic(base_url=agent_api_server.url, api_key=KEY, max_retries=0, timeout=300)
    m = messages.messages.create(model=MODEL_NAME, max_tokens=120, messages=USER,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 tools=[{"name": "add_person", "input_schema": schema},
                                        {"name": "get_time", "input_schema": other}])
    assert m.stop_reason in ("tool_use", "max_tokens") and any(b.type == "tool_use" for b in m.content), m
    for call in [c for c in calls if c.function.name == "add_person"]:
        Person.model_validate_json(call.function.arguments)


def test_truncation_side_and_logprob_token_ids(agent_api_server):
    prompt = "The quick brown fox jumps over the lazy dog."
    kw = dict(json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 3,
                    "truncation_side": "right"}, headers=AUTH, timeout=60)
    r = httpx.post(agent_api_server.url + "/v1/completions", **kw)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("The"), r.text
    r = httpx.post(agent_api_server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL_NAME, "messages": USER, "max_tokens": 1, "logprob_token_ids": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids", r.text


def test_chat_stop_reason_is_null_for_eos(scripted_api_server):
    client = openai.OpenAI(base_url=scripted_api_server.base_url, api_key="none", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=16)
    choice = r.choices[0]
    assert choice.message.content == "Hello from PagedDesk." and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] is None


def test_unknown_fields_are_ignored_and_named_on_messages_and_responses(agent_api_server):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": USER, "bogus": 1,
            "thinking": {"type": "adaptive", "future_knob": True}}
    r = httpx.post(agent_api_server.url + "/v1/messages", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-pagedesk-ignored-fields"] == "bogus, thinking.future_knob"
    body = {"model": MODEL_NAME, "max_output_tokens": 2, "input": "hi", "frobnicate": {"x": 1},
            "reasoning": {"effort": "low", "mode": "deep"}, "tools": [{**EXEC, "eager": True}]}
    r = httpx.post(agent_api_server.base_url + "/responses", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-pagedesk-ignored-fields"] == "frobnicate, reasoning.mode, tools.0.eager"
    assert r.json()["reasoning"] == {"effort": "low", "summary": None}


def test_ignored_field_names_are_made_header_safe():
    from engine.entrypoints.openai.ignored_fields import MAX_HEADER_FIELDS, header_value
    assert header_value(["a\r\nSet-Cookie: x", "é", "", "messages.0.mood"]) == \
        '"a\\r\\nSet-Cookie: x", "\\u00e9", "", messages.0.mood'
    long = header_value([f"f{i}" for i in range(MAX_HEADER_FIELDS + 5)] + ["x" * 500])
    assert long.endswith(", ... (6 more)") and len(long) < 400
