"""Honest request handling: every refused field in docs/server.md gets a 400 naming it, harmless values and
the fields real clients send are accepted, unknown fields are a 400, and models/usage carry what clients read."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from engine.server.refusals import BY_FIELD, REFUSALS
from server_harness import MODEL_NAME, start_server

DOCS = Path(__file__).resolve().parents[1] / "docs" / "server.md"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def documented_refusals() -> list[str]:
    text = DOCS.read_text(encoding="utf-8")
    table = text.split("<!-- refused-fields")[1].split("\n\n")[0]
    return re.findall(r"^\| `([a-z_.]+)` \|", table, flags=re.M)


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir)
    yield srv
    srv.stop()


def _body_with(field: str, value) -> dict:
    if "." in field:
        outer, inner = field.split(".")
        return {outer: {inner: value}}
    return {field: value}


def test_docs_list_every_refusal_and_nothing_else():
    assert documented_refusals() == [r.field for r in REFUSALS]


@pytest.mark.parametrize("field", documented_refusals())
@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_each_documented_refusal_is_a_400_naming_the_field(server, field, route):
    body = {"model": MODEL_NAME, "max_tokens": 2, **_body_with(field, BY_FIELD[field].refused_example)}
    body.update({"messages": USER} if route == CHAT else {"prompt": "hi"})
    if field.startswith("stream_options"):
        body["stream"] = True
    r = httpx.post(server.url + route, json=body, timeout=30)
    assert r.status_code == 400, (field, r.text)
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "messages.0.mood"),
    ({"messages": USER, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
    ({"messages": USER, "response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
])
def test_fields_outside_both_apis_are_400(server, body, param):
    r = httpx.post(server.url + CHAT, json={"model": MODEL_NAME, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "unknown field" in error["message"], error


def test_harmless_values_are_accepted(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=2, store=False, service_tier="auto", user="u-1",
        metadata={"k": "v"}, modalities=["text"], prompt_cache_key="k", safety_identifier="s",
        extra_body={"priority": 0, "length_penalty": 1.0, "use_beam_search": False, "guided_decoding_backend": "auto",
                    "spaces_between_special_tokens": True, "bad_words": [], "suffix": None})
    assert r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, suffix="", user="u",
                                  extra_body={"return_token_ids": False, "best_of": 1})
    assert r.choices[0].text is not None


def test_models_carry_context_length(server):
    card = httpx.get(server.base_url + "/models").json()["data"][0]
    assert card["max_model_len"] == card["context_length"] == 256


def test_usage_counts_cached_prompt_tokens(server):
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several full 16-token blocks
    first = httpx.post(server.url + COMPLETIONS, json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1},
                       timeout=30).json()["usage"]
    second = httpx.post(server.url + COMPLETIONS, json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1},
                        timeout=30).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < second["prompt_tokens"]


def test_continuous_usage_stats(server):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 4 and events[-1]["usage"]["completion_tokens"] == 4


def test_truncate_prompt_tokens_keeps_the_tail(server):
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 1,
            "echo": True, "truncate_prompt_tokens": 3}
    r = httpx.post(server.url + COMPLETIONS, json=body, timeout=30).json()
    assert r["usage"]["prompt_tokens"] == 3 and r["choices"][0]["text"].startswith(" dog.")


def test_request_id_names_the_response(server):
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 1, "request_id": "job-42"}
    assert httpx.post(server.url + CHAT, json=body, timeout=30).json()["id"] == "chatcmpl-job-42"


def test_chat_echo_prepends_the_assistant_message(server):
    body = {"model": MODEL_NAME, "messages": USER + [{"role": "assistant", "content": "Once upon"}], "max_tokens": 2,
            "echo": True, "add_generation_prompt": False, "continue_final_message": True}
    r = httpx.post(server.url + CHAT, json=body, timeout=30).json()
    assert r["choices"][0]["message"]["content"].startswith("Once upon")


def test_return_token_ids(server):
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 3, "ignore_eos": True,
            "return_token_ids": True}
    choice = httpx.post(server.url + COMPLETIONS, json=body, timeout=30).json()["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["prompt_token_ids"]
    tokens = httpx.post(server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": "hello there"}).json()
    assert choice["prompt_token_ids"] == tokens["tokens"]
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 3, "ignore_eos": True, "return_token_ids": True,
            "stream": True}
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert sum(len(c.get("token_ids") or []) for e in events for c in e["choices"]) == 3
