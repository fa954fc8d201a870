"""Bad input gets a 4xx in OpenAI's error shape and the server keeps serving; a dead or loading engine is 503."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, start_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
LONG = "numbers 0 1 2 3 4 5 6 7 8 9 10 " * 40  # several hundred tokens; max_model_len is 256

BAD_REQUESTS = {
    "empty prompt": (COMPLETIONS, {"prompt": ""}),
    "empty prompt list": (COMPLETIONS, {"prompt": []}),
    "empty token list in batch": (COMPLETIONS, {"prompt": [[]]}),
    "empty messages": (CHAT, {"messages": []}),
    "prompt over max_model_len": (COMPLETIONS, {"prompt": LONG}),
    "chat over max_model_len": (CHAT, {"messages": [{"role": "user", "content": LONG}]}),
    "prompt + max_tokens over max_model_len": (COMPLETIONS, {"prompt": "hello", "max_tokens": 255}),
    "max_tokens 0": (COMPLETIONS, {"prompt": "hello", "max_tokens": 0}),
    "max_tokens negative": (COMPLETIONS, {"prompt": "hello", "max_tokens": -5}),
    "max_completion_tokens 0": (CHAT, {"messages": USER, "max_completion_tokens": 0}),
    "scoring with n over 1": (COMPLETIONS, {"prompt": "hello", "echo": True, "max_tokens": 0, "n": 2}),
    "n over cap": (COMPLETIONS, {"prompt": "hello", "n": 17}),
    "n zero": (CHAT, {"messages": USER, "n": 0}),
    "temperature negative": (CHAT, {"messages": USER, "temperature": -0.5}),
    "top_p zero": (CHAT, {"messages": USER, "top_p": 0}),
    "top_p over one": (COMPLETIONS, {"prompt": "hello", "top_p": 1.5}),
    "top_k below -1": (CHAT, {"messages": USER, "top_k": -2}),
    "min_p over one": (CHAT, {"messages": USER, "min_p": 2}),
    "frequency_penalty out of range": (CHAT, {"messages": USER, "frequency_penalty": 3}),
    "repetition_penalty zero": (CHAT, {"messages": USER, "repetition_penalty": 0}),
    "seed below -1 (-1 means random)": (CHAT, {"messages": USER, "seed": -2}),
    "completions logprobs over 20": (COMPLETIONS, {"prompt": "hello", "logprobs": 21}),
    "chat top_logprobs over 20": (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}),
    "top_logprobs without logprobs": (CHAT, {"messages": USER, "top_logprobs": 2}),
    "logit_bias id outside vocab": (CHAT, {"messages": USER, "logit_bias": {"999999": 5}}),
    "logit_bias key not an id": (CHAT, {"messages": USER, "logit_bias": {"abc": 5}}),
    "logit_bias value out of range": (CHAT, {"messages": USER, "logit_bias": {"5": 1000}}),
    "stop_token_ids outside vocab": (COMPLETIONS, {"prompt": "hello", "stop_token_ids": [10**9]}),
    "prompt ids outside vocab": (COMPLETIONS, {"prompt": [1, 2, 10**9]}),
    "negative prompt id": (COMPLETIONS, {"prompt": [1, -2]}),
    "1000 stop strings": (COMPLETIONS, {"prompt": "hello", "stop": [f"s{i}" for i in range(1000)]}),
    "empty stop string": (COMPLETIONS, {"prompt": "hello", "stop": [""]}),
    "min_tokens over max_tokens": (COMPLETIONS, {"prompt": "hello", "max_tokens": 2, "min_tokens": 5}),
    "image part": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}),
    "tools without template support": (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]}),
    "tool_choice required without tools": (CHAT, {"messages": USER, "tool_choice": "required"}),
    "unknown response_format type": (CHAT, {"messages": USER, "response_format": {"type": "yaml"}}),
    "unknown role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}),
    "prompt of wrong type": (COMPLETIONS, {"prompt": {"a": 1}}),
    "missing prompt": (COMPLETIONS, {}),
    "suffix": (COMPLETIONS, {"prompt": "hello", "suffix": "end"}),
    "best_of over n": (COMPLETIONS, {"prompt": "hello", "best_of": 3}),
    "tokenize both prompt and messages": ("/tokenize", {"prompt": "a", "messages": USER}),
    "detokenize id outside vocab": ("/detokenize", {"tokens": [10**9]}),
}

RAW_BAD_BODIES = {
    "lone surrogate in prompt": (COMPLETIONS, b'{"prompt": "hi \\ud800 there"}'),
    "lone surrogate in message": (CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
    "lone surrogate in stop": (COMPLETIONS, b'{"prompt": "hi", "stop": ["\\ud83d"]}'),
    "invalid utf-8": (COMPLETIONS, b'{"prompt": "caf\xc3\x28 \xff\xfe"}'),
    "malformed json": (COMPLETIONS, b'{"prompt": "hi",'),
    "NaN temperature": (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    "Infinity logit bias": (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": Infinity}}'),
    "json array body": (COMPLETIONS, b'[1, 2, 3]'),
}


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir)
    yield srv
    srv.stop()


def assert_error_shape(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500 if status is None else r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def assert_still_serving(server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + COMPLETIONS, json={"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_400(server, case):
    path, body = BAD_REQUESTS[case]
    for stream in (False, True) if path in (CHAT, COMPLETIONS) else (False,):
        r = httpx.post(server.url + path, json={"model": MODEL_NAME, **body, "stream": stream}, timeout=30)
        error = assert_error_shape(r, 400)
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("case", list(RAW_BAD_BODIES))
def test_malformed_body_is_400(server, case):
    path, body = RAW_BAD_BODIES[case]
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert_error_shape(r, 400)


def test_error_messages_name_the_problem(server):
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": "hello", "max_tokens": 255})
    assert "256" in r.json()["error"]["message"] and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(server.url + CHAT, json={"messages": USER, "temperature": -1})
    assert "temperature" in r.json()["error"]["message"]


def test_unknown_model_is_404(server):
    r = httpx.post(server.url + CHAT, json={"model": "gpt-9", "messages": USER})
    assert assert_error_shape(r, 404)["code"] == "model_not_found"
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=USER)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=-1)


def test_body_over_limit_is_413(server):
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": "x" * (5 * 1024 * 1024)}, timeout=30)
    assert_error_shape(r, 413)
    assert httpx.get(server.url + "/v1/nope").status_code == 404
    assert_error_shape(httpx.get(server.url + "/v1/nope"), 404)
    assert_error_shape(httpx.get(server.url + COMPLETIONS), 405)
    assert_still_serving(server)


def test_server_survives_every_bad_request(server):
    assert_still_serving(server)
    assert server.async_engine.status == "ready"


def test_loading_engine_answers_503(llama_dir):
    release = threading.Event()

    def slow_factory(config):
        from engine.entrypoints.llm_engine import LLMEngine
        release.wait(30)
        return LLMEngine(config)

    srv = start_server(llama_dir, wait_loaded=False, engine_factory=slow_factory)
    try:
        r = httpx.get(srv.url + "/health")
        assert assert_error_shape(r, 503)["code"] == "model_loading"
        assert_error_shape(httpx.post(srv.url + CHAT, json={"messages": USER}), 503)
        assert httpx.get(srv.url + "/metrics").status_code == 200
        release.set()
        assert srv.async_engine.wait_until_loaded(60)
        assert_still_serving(srv)
    finally:
        release.set()
        srv.stop()


def test_dead_engine_answers_503_and_fails_in_flight_requests(llama_dir):
    armed = threading.Event()

    def fragile_factory(config):
        from engine.entrypoints.llm_engine import LLMEngine
        engine = LLMEngine(config)
        real_step = engine.step

        def step():
            if armed.is_set():
                raise RuntimeError("simulated CUDA error in step")
            return real_step()

        engine.step = step
        return engine

    srv = start_server(llama_dir, engine_factory=fragile_factory)
    try:
        body = {"prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + COMPLETIONS, json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith("data: {")
            armed.set()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "simulated CUDA error" in rest[-2]
        health = assert_error_shape(httpx.get(srv.url + "/health"), 503)
        assert health["code"] == "engine_dead" and "simulated" not in health["message"]  # open route: no internals
        r = httpx.post(srv.url + COMPLETIONS, json={"prompt": "hello", "max_tokens": 2})
        assert assert_error_shape(r, 503)["code"] == "engine_dead"
        assert_error_shape(httpx.get(srv.url + "/v1/engine/state"), 503)
    finally:
        srv.stop()
