"""Fuzz the request models' numeric fields at their extremes: after every case the engine still serves.

The numeric fields of a completions or chat request are found by walking the pydantic models (a new field
is fuzzed without touching this file). A sweep sends every field alone with every extreme value (int64
and float64 edges, just past them, zero, negative); hypothesis then combines two or three of them. The
response must not be a 5xx, a 400 must name a field, and the engine must still be "ready" after every
case. Bounded: a fixed, derandomized set of cases against a 32-token context.
"""
from __future__ import annotations

import types
import typing

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from server_harness import start_server

COMBINED_CASES = 30
INTS = [0, 1, -1, 3, 2**31, -2**31 - 1, 2**63 - 1, 2**63, -2**63 - 1, 2**64]
FLOATS = [-0.0, 0.5, -1.0, 5e-324, 2.0, 1e18, 1e308, -1e308]
EDGE_INTS, EDGE_FLOATS = [2**63 - 1, 2**63, -2**63 - 1, 2**64], [1e308, -1e308, 5e-324]  # the sweep's values
ROUTES = {"/v1/completions": (CompletionRequest, {"prompt": "hi", "max_tokens": 2}),
          "/v1/chat/completions": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2})}


def _kinds(annotation) -> set:
    """The numeric kinds inside an annotation (unions, Annotated, dict values): int, float, and "list" when
    the numbers come in a list (stop_token_ids, token-id prompts)."""
    if annotation in (int, float):
        return {annotation}
    found = set()
    for arg in typing.get_args(annotation):
        if arg is not bool and not isinstance(arg, (str, bytes, types.NoneType)):
            inner = _kinds(arg)
            if inner and typing.get_origin(arg) is list:
                inner.add("list")
            found |= inner
    return found


def numeric_fields(model) -> dict[str, set]:
    return {name: kinds for name, f in model.model_fields.items() if (kinds := _kinds(f.annotation))}


def _value(kinds: set):
    scalar = st.sampled_from(INTS + FLOATS if float in kinds else INTS)
    return st.lists(scalar, min_size=1, max_size=2) if "list" in kinds else scalar


def _case():
    def for_route(path):
        fields = numeric_fields(ROUTES[path][0])
        names = st.lists(st.sampled_from(sorted(fields)), min_size=2, max_size=3, unique=True)
        return names.flatmap(lambda ns: st.fixed_dictionaries({n: _value(fields[n]) for n in ns})).map(
            lambda extra: (path, {**ROUTES[path][1], **extra}))
    return st.sampled_from(sorted(ROUTES)).flatmap(for_route)


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir, max_model_len=32, num_gpu_blocks_override=64)
    yield srv
    srv.stop()


def test_the_fuzz_reaches_the_fields_that_killed_the_engine():
    fields = numeric_fields(CompletionRequest)
    assert {"top_k", "stop_token_ids", "length_penalty", "truncate_prompt_tokens", "n", "best_of",
            "logprobs", "max_tokens"} <= set(fields)
    assert "top_logprobs" in numeric_fields(ChatCompletionRequest)


def _send(server, path: str, body: dict, failures: list) -> None:
    if body.get("use_beam_search") is None and "length_penalty" in body:
        body["use_beam_search"] = True  # length_penalty only counts in a beam search
    r = httpx.post(server.url + path, json=body, timeout=60)
    if r.status_code >= 500 or server.async_engine.status != "ready":
        failures.append((path, body, r.status_code, r.text[:200]))
    elif r.status_code == 400 and not r.json()["error"]["param"]:
        failures.append((path, body, "400 without param", r.text[:200]))


def test_every_numeric_field_alone_at_every_extreme(server):
    failures, sent = [], 0
    for path, (model, base) in ROUTES.items():
        for name, kinds in numeric_fields(model).items():
            for value in EDGE_INTS + (EDGE_FLOATS if float in kinds else []):
                body = dict(base)
                body[name] = [value] if "list" in kinds else value
                _send(server, path, body, failures)
                sent += 1
    print(f"{sent} single-field cases")
    assert not failures, failures


def test_numeric_extremes_combined_never_kill_the_engine(server):
    failures = []

    @settings(max_examples=COMBINED_CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=_case())
    def check(case):
        _send(server, *case, failures)

    check()
    assert not failures, failures
    assert httpx.get(server.url + "/health").status_code == 200
