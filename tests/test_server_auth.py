"""--api-key: every /v1 route, /tokenize and /detokenize need the bearer token, checked before the body is
parsed; /health, /metrics and the API description (/openapi.json, /docs, /redoc) do not."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, start_server

KEY = "sk-local-test-key"
GUARDED = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
           ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
           ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
           ("GET", "/v1/engine/state", None)]


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir, api_key=KEY)
    yield srv
    srv.stop()


@pytest.mark.parametrize("method,path,body", GUARDED)
def test_guarded_routes_need_the_key(server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text


def test_state_stream_needs_the_key(server):
    assert httpx.get(server.url + "/v1/engine/state/stream").status_code == 401


def test_health_and_metrics_are_open(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    for path in ("/openapi.json", "/docs", "/redoc"):  # the schema, never data: open on purpose (docs/server.md)
        assert httpx.get(server.url + path).status_code == 200, path


def test_key_is_checked_before_the_body_is_parsed(server):
    for body in (b"{not json", b'{"prompt": 5}'):
        r = httpx.post(server.base_url + "/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert httpx.post(server.url + "/nope").status_code == 401  # unknown routes say nothing either


def test_metrics_label_a_folder_model_by_name_not_path(llama_dir):
    from engine.entrypoints.openai.app import metrics_model_name
    assert metrics_model_name(str(llama_dir)) == llama_dir.name and str(llama_dir.parent) not in llama_dir.name
    assert metrics_model_name("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"  # hub id: no folder


def test_sdk_with_and_without_key(server):
    good = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2).choices
    bad = openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_no_key_means_open(llama_dir):
    srv = start_server(llama_dir)
    try:
        assert httpx.get(srv.base_url + "/models", headers={"Authorization": "Bearer anything"}).status_code == 200
        assert httpx.get(srv.base_url + "/models").status_code == 200
    finally:
        srv.stop()
