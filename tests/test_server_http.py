"""HTTP-level behaviour browsers, probes and scrapers rely on: HEAD /health and /metrics, a 404 naming a missing
route (OpenAI's error shape), and CORS only for the origins `--allowed-origins` names (preflight answered before
the API-key check; no CORS headers at all without the flag)."""
from __future__ import annotations

import httpx
import pytest

from engine.entrypoints.openai.cors import allowed_origin_list
from server_harness import MODEL_NAME, start_server

UI = "http://ui.test:3000"
PREFLIGHT = {"Origin": UI, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir, api_key="k", allowed_origins=f"{UI}, https://other.test")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain_server(llama_dir):
    srv = start_server(llama_dir, wait_loaded=False)
    yield srv
    srv.stop()


def test_head_health_and_metrics(server):
    for path in ("/health", "/metrics"):
        r = httpx.head(server.url + path, timeout=30)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
        assert r.headers["content-type"] == httpx.get(server.url + path, timeout=30).headers["content-type"]


@pytest.mark.parametrize("method, path", [("POST", "/v1/nope"), ("GET", "/v2/models"), ("POST", "/v1/messagez")])
def test_missing_route_is_a_404_naming_it(server, method, path):
    r = httpx.request(method, server.url + path, json={}, headers={"Authorization": "Bearer k"}, timeout=30)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert f"{method} {path}" in error["message"] and error["code"] == "unknown_url", error
    assert error["type"] == "not_found_error"


def test_wrong_method_names_the_route(server):
    r = httpx.get(server.base_url + "/chat/completions", headers={"Authorization": "Bearer k"}, timeout=30)
    assert r.status_code == 405 and "GET /v1/chat/completions" in r.json()["error"]["message"], r.text


def test_preflight_and_request_from_an_allowed_origin(server):
    r = httpx.options(server.base_url + "/chat/completions", headers=PREFLIGHT, timeout=30)
    assert r.status_code == 200, r.text  # answered before the key check: a preflight carries no key
    assert r.headers["access-control-allow-origin"] == UI
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=30,
                   headers={"Origin": UI, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=30, headers={"Origin": UI})
    assert r.status_code == 401  # CORS opens the origin, never the key


def test_other_origins_get_no_cors_headers(server, plain_server):
    evil = dict(PREFLIGHT, Origin="http://evil.test")
    r = httpx.options(server.base_url + "/chat/completions", headers=evil, timeout=30)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    for headers in (PREFLIGHT, evil):  # without --allowed-origins: no origin is allowed
        r = httpx.options(plain_server.base_url + "/chat/completions", headers=headers, timeout=30)
        assert r.status_code != 200 and "access-control-allow-origin" not in r.headers, r.headers
        r = httpx.get(plain_server.url + "/health", headers={"Origin": headers["Origin"]}, timeout=30)
        assert "access-control-allow-origin" not in r.headers


def test_allowed_origin_forms():
    assert allowed_origin_list(None) == [] and allowed_origin_list(" ") == []
    assert allowed_origin_list("http://a:1, https://b/") == ["http://a:1", "https://b"]
    assert allowed_origin_list('["http://a:1", "*"]') == ["http://a:1", "*"]
    with pytest.raises(ValueError, match="allowed-origins"):
        allowed_origin_list('["http://a"')
