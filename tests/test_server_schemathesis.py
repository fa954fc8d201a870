"""schemathesis against /openapi.json, positive and negative modes: no request may get a 5xx, and the
engine is still serving after every case.

Examples are bounded per operation and the model's context is short (max_model_len 32), so every
generated request finishes fast; the infinite engine-state stream is left out (it is tested directly).
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from server_harness import start_server

EXAMPLES_PER_OPERATION = 12
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/v1/engine/state"), ("GET", "/health"),
              ("GET", "/metrics"), ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("DELETE", "/v1/responses/{response_id}"), ("POST", "/v1/responses/compact"), ("POST", "/v1/messages"),
              ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/embeddings")]


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir, max_model_len=32, num_gpu_blocks_override=128)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def test_schema_lists_every_route(schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert set(OPERATIONS) | {("GET", "/v1/engine/state/stream")} == listed


CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + \
    [(m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"]  # GETs here take no input to break


@pytest.mark.parametrize("method,path,mode", CASES)
def test_no_server_errors(server, schema, method, path, mode):
    operation = schema[path][method]
    failures = []

    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        response = case.call(base_url=server.url, timeout=60)
        if response.status_code >= 500 or server.async_engine.status != "ready":  # alive after every case
            failures.append((case.body, response.status_code, response.text[:300]))

    check()
    assert not failures, failures
    assert server.async_engine.status == "ready"

