"""Honest request handling: every field of the openai SDK's request types and of vLLM's extras is declared, the
current OpenAI fields are accepted (reasoning_effort reaching the template), an SDK message round-trips, every
refused field in docs/server.md gets a 400 naming it, unknown fields (at any depth, on every API) are ignored and
named in the x-pagedesk-ignored-fields header, or a 400 naming them under --strict-request-fields, and
models/usage carry what clients read."""
from __future__ import annotations

import json
import re
import typing
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from engine.entrypoints.openai.prompts import render_chat, template_kwargs
from engine.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions
from engine.entrypoints.openai.refusals import BY_FIELD, REFUSALS
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


@pytest.fixture(scope="module")
def strict_server(llama_dir):
    srv = start_server(llama_dir, strict_request_fields=True)
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


OUTSIDE_BOTH_APIS = [
    ({"messages": USER, "frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "messages.0.mood"),
    ({"messages": USER, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
    ({"messages": USER, "response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
]


@pytest.mark.parametrize("body, param", OUTSIDE_BOTH_APIS)
def test_fields_outside_both_apis_are_400(strict_server, body, param):
    """--strict-request-fields: the policy before agent clients (unknown fields refused, by their path)."""
    r = httpx.post(strict_server.url + CHAT, json={"model": MODEL_NAME, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "unknown field" in error["message"], error


@pytest.mark.parametrize("body, param", OUTSIDE_BOTH_APIS)
def test_fields_outside_both_apis_are_ignored_and_named(server, body, param):
    body = {"model": MODEL_NAME, "max_tokens": 2, **body}
    if "stream_options" in body:
        body["stream"] = True
    r = httpx.post(server.url + CHAT, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-pagedesk-ignored-fields"] == param


def test_a_clean_request_has_no_ignored_fields_header(server):
    r = httpx.post(server.url + CHAT, json={"model": MODEL_NAME, "max_tokens": 1, "messages": USER}, timeout=30)
    assert r.status_code == 200 and "x-pagedesk-ignored-fields" not in r.headers


def test_strict_fields_on_the_messages_and_responses_routes(strict_server):
    """What the Messages and Responses tests refused before unknown fields and hosted tools were ignored."""
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": USER}
    r = httpx.post(strict_server.url + "/v1/messages", json={**body, "bogus": 1}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "bogus" in r.json()["error"]["message"], r.json()
    client = openai.OpenAI(base_url=strict_server.base_url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL_NAME, input="x", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools.0.type", err.value.body


def test_stream_options_need_stream(server):
    r = httpx.post(server.url + CHAT, json={"model": MODEL_NAME, "messages": USER, "max_tokens": 1,
                                            "stream_options": {"include_usage": True}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


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


# vLLM's request extras (vllm/entrypoints/openai protocol) on both routes, and the chat-only ones.
VLLM_FIELDS = ["best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
               "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
               "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
               "bad_words", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
               "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
               "kv_transfer_params", "vllm_xargs", "prompt_embeds"]
VLLM_CHAT_FIELDS = ["echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
                    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs",
                    "include_reasoning", "reasoning_effort"]


def _declared(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()} | set(model.model_fields)


def test_every_field_of_the_openai_sdk_and_vllm_is_declared():
    """The installed openai SDK's own parameter types are the OpenAI schema: a field it knows and we do not
    declare would be an 'unknown field' 400."""
    from openai.types import completion_create_params as completion_params
    from openai.types.chat import ChatCompletionStreamOptionsParam, completion_create_params as chat_params
    for sdk, ours, extra in ((chat_params.CompletionCreateParamsBase, ChatCompletionRequest, VLLM_CHAT_FIELDS),
                             (completion_params.CompletionCreateParamsBase, CompletionRequest, [])):
        missing = set(typing.get_type_hints(sdk)) | set(VLLM_FIELDS) | set(extra)
        assert missing - _declared(ours) == set(), ours.__name__
    assert set(ChatCompletionStreamOptionsParam.__annotations__) <= _declared(StreamOptions)
    from openai.types.chat import ChatCompletionMessage
    assert set(ChatCompletionMessage.model_fields) <= _declared(ChatMessage)


def test_current_openai_fields_are_accepted(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}},
            "cache_control": {"type": "ephemeral"}}
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=2, reasoning_effort="high", verbosity="low", store=True,
        prompt_cache_key="k", safety_identifier="s", seed=-1, tools=[tool], tool_choice="none",
        extra_body={"prompt_cache_options": {"mode": "implicit"}})
    assert r.choices[0].finish_reason == "length"
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, "n": None, "stream": None, "logprobs": None,
            "echo": None, "seed": -1}
    r = httpx.post(server.url + CHAT, json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "n": None, "stream": None, "logprobs": None,
            "echo": None, "seed": -1, "store": True, "verbosity": "high"}
    r = httpx.post(server.url + COMPLETIONS, json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    stream = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True, "include_obfuscation": False})
    assert [c.usage for c in stream][-1].completion_tokens == 2
    for seed, param in ((-2, "seed"),):
        r = httpx.post(server.url + CHAT, json={"model": MODEL_NAME, "messages": USER, "seed": seed}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_sdk_assistant_message_round_trips(server):
    """`message.model_dump()` of the SDK's own response sent back as history (annotations, refusal, audio,
    function_call: what OpenAI's response objects carry) is accepted and ignored."""
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    first = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=3)
    dumped = first.choices[0].message.model_dump()
    assert {"annotations", "refusal", "audio", "function_call"} <= set(dumped)
    with_annotations = dict(dumped, annotations=[{"type": "url_citation", "url_citation": {
        "url": "https://example.com", "title": "t", "start_index": 0, "end_index": 1}}])
    for message in (dumped, with_annotations):
        r = client.chat.completions.create(model=MODEL_NAME, max_tokens=2,
                                           messages=USER + [message, {"role": "user", "content": "more"}])
        assert r.choices[0].finish_reason == "length"
    r = httpx.post(server.url + CHAT, timeout=30, json={"model": MODEL_NAME, "max_tokens": 2, "messages": USER + [
        dict(dumped, audio={"id": "audio_1"})]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.audio", r.text


THINKING_TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                     "|effort={{ reasoning_effort | default('unset') }}"
                     "|thinking={{ enable_thinking | default('unset') }}")


@pytest.mark.parametrize("template, effort, kwargs, shown", [
    (THINKING_TEMPLATE, "high", None, "hi|effort=high|thinking=True"),
    (THINKING_TEMPLATE, "none", None, "hi|effort=none|thinking=False"),
    (THINKING_TEMPLATE, "low", {"enable_thinking": True, "reasoning_effort": "medium"},
     "hi|effort=medium|thinking=True"),
    (THINKING_TEMPLATE, None, None, "hi|effort=unset|thinking=unset"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}|{{ enable_thinking | default('unset') }}", "minimal",
     None, "hi|True"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "high", None, "hi"),
])
def test_reasoning_effort_reaches_the_template(llama_dir, template, effort, kwargs, shown):
    """Passed only as the variables the template reads; the client's chat_template_kwargs win."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    tokenizer.chat_template = template
    model = SimpleNamespace(name="m", tokenizer=tokenizer, supports_tools=False, max_model_len=256,
                            supports_images=False)
    text = render_chat(model, [ChatMessage(role="user", content="hi")], None, add_generation_prompt=False,
                       chat_template_kwargs=template_kwargs(model, kwargs, effort))
    assert text == shown
    if "enable_thinking" not in template:
        assert template_kwargs(model, None, effort) is None
