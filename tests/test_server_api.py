"""The OpenAI-compatible server against a real uvicorn on 127.0.0.1, driven by the official `openai` SDK.

A tiny random-weight llama serves: chat and completions, streamed == whole for greedy, n with a seed,
stop strings, logprobs, usage, echo, tokenize/detokenize, models, metrics names, engine state.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, start_server
from engine.entrypoints.openai.engine_state import unpack_blocks

GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


def greedy(**extra):
    return dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True, **extra})


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _extra(**kw):
    return {"extra_body": kw}


def test_completion_and_chat_basics(client):
    r = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1 and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 5 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    c = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=6, temperature=0)
    assert c.choices[0].message.role == "assistant" and isinstance(c.choices[0].message.content, str)
    assert c.usage.prompt_tokens > 0 and 1 <= c.usage.completion_tokens <= 6


def test_streamed_text_equals_whole_text_for_greedy(client):
    prompt = "PagedAttention splits the KV cache"
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Continuous batching?"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_raw_sse_ends_with_done(server):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_n_with_seed_is_distinct_and_reproducible(client):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "tell me"}], n=3, seed=1234,
              temperature=1.0, max_tokens=10, **_extra(ignore_eos=True))
    first = client.chat.completions.create(**kw)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert first.usage.completion_tokens == 30
    streamed: dict[int, str] = {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts


def test_batch_prompts_give_n_choices_each(client):
    r = client.completions.create(model=MODEL_NAME, prompt=["one", "two"], n=2, max_tokens=3, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]


def test_stop_string_ends_the_text(client):
    prompt = "numbers 0 1 2 3"
    text = client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY).choices[0].text
    printable = [i for i in range(2, len(text) - 1) if text[i].isprintable() and text[i] != "\ufffd"]
    assert printable, f"greedy text {text!r} has no printable character to stop on"
    stop = text[printable[0]]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    assert r.choices[0].text == text[:text.index(stop)]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, stop=[stop],
                                  **greedy(include_stop_str_in_output=True))
    assert r.choices[0].text == text[:text.index(stop) + 1]


def test_logprobs(client):
    c = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob)  # greedy picks the top token
        lps = [t.logprob for t in tok.top_logprobs]
        assert lps == sorted(lps, reverse=True)
    r = client.completions.create(model=MODEL_NAME, prompt="hello", logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                 logprobs=True, top_logprobs=3, stream=True, **GREEDY))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content])


def test_echo_prepends_prompt(client):
    r = client.completions.create(model=MODEL_NAME, prompt="echo me", echo=True, **GREEDY)
    plain = client.completions.create(model=MODEL_NAME, prompt="echo me", **GREEDY)
    assert r.choices[0].text == "echo me" + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="echo me", echo=True, stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text


def test_token_id_prompt_and_usage_match_tokenize(server, client):
    tok = httpx.post(server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": "Hello world",
                                                     "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 256
    by_text = client.completions.create(model=MODEL_NAME, prompt="Hello world", **GREEDY)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=tok["tokens"], **GREEDY)
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == tok["count"]
    assert by_text.choices[0].text == by_ids.choices[0].text
    detok = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"].endswith("Hello world")
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    c = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], **GREEDY)
    assert chat["count"] == c.usage.prompt_tokens


def test_models_health_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"pagedesk:{name}" in text, name
    assert 'pagedesk:generation_tokens_total{model_name="tiny"}' in text


def test_engine_state_snapshot_and_stream(server):
    state = httpx.get(server.base_url + "/engine/state").json()
    assert state["model"] == MODEL_NAME and state["device"] == "cpu" and state["num_blocks"] == 512
    s, ref, owner = unpack_blocks(state["blocks"], state["num_blocks"])
    assert not (s == 1).any() and not ref.any() and not owner.any()
    assert state["memory"]["kv_cache_bytes"] > 0 and state["memory"]["weights_bytes"] > 0
    with httpx.stream("GET", server.base_url + "/engine/state/stream", params={"hz": 20}, timeout=10) as r:
        assert r.status_code == 200
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break
    assert [e["num_blocks"] for e in events] == [512] * 3 and events[0]["time"] < events[2]["time"]
    assert httpx.get(server.base_url + "/engine/state/stream", params={"hz": 100}).status_code == 400


def test_engine_state_shows_running_request(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    seen = []

    def watch():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not seen:
            state = httpx.get(server.base_url + "/engine/state").json()
            if state["requests"]:
                seen.append(state)
            time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    stream = client.completions.create(model=MODEL_NAME, prompt="a long story " * 5, max_tokens=200,
                                       temperature=0, stream=True, **_extra(ignore_eos=True))
    for _ in stream:
        if seen:
            break
    stream.close()
    t.join()
    assert seen, "no snapshot showed the running request"
    state = seen[0]
    row = state["requests"][0]
    assert row["id"].startswith("cmpl-") and row["num_blocks"] >= 1 and row["num_prompt_tokens"] > 0
    s, _, owner = unpack_blocks(state["blocks"], state["num_blocks"])
    assert int((owner == 1).sum()) == row["num_blocks"] and (s[owner == 1] == 1).all()
