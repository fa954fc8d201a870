"""One request must never kill the engine: a fault in one request's part of a step fails that request only
(error output, blocks freed) while the others finish HF-identical; the API refuses the values that used to
kill the engine (issue 27's reported killers) with a 400 naming the field."""
from __future__ import annotations

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.core.beam_search import BeamGroup, BeamSearchParams, length_normalized
from engine.core.detokenizer import IncrementalDetokenizer
from engine.entrypoints.llm_engine import LLMEngine
from engine.core.output_processor import OutputProcessor
from hf_reference import MAX_TOKENS
from server_harness import start_server

VICTIM = "victim"


@pytest.fixture(scope="module")
def llm(reference):
    path, _, _ = reference("llama")
    return LLM(str(path), device="cpu", num_gpu_blocks_override=64, max_num_seqs=8)


def _run(engine: LLMEngine, prompts, max_tokens, victim_index: int, beam: bool = False):
    """Each prompt as its own request (the victim's id is VICTIM), stepped until all are done."""
    ids = []
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        rid = VICTIM if i == victim_index else f"r{i}"
        if beam and i == victim_index:
            engine.add_beam_request(rid, prompt, BeamSearchParams(beam_width=2, max_tokens=n))
        else:
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n))
        ids.append(rid)
    done = {}
    for _ in range(2000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(done) == set(ids)
    return done


def _raise_for_victim(original, request_of):
    def patched(*args, **kwargs):
        if request_of(*args).request_id == VICTIM:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)
    return patched


STAGES = {
    # stage -> (class, method, how to find the request from the call's arguments)
    "preparing its sampling rows": (LLMEngine, "_plan_row", lambda self, plan, row, seq: seq.request),
    "processing its new token": (OutputProcessor, "append_token", lambda self, seq, *rest: seq.request),
    "building its output": (OutputProcessor, "make_output", lambda self, request: request),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_in_one_request_fails_only_that_request(llm, reference, monkeypatch, stage):
    _, prompts, expected = reference("llama")
    cls, name, request_of = STAGES[stage]
    monkeypatch.setattr(cls, name, _raise_for_victim(getattr(cls, name), request_of))
    engine = llm.engine
    done = _run(engine, prompts, MAX_TOKENS, victim_index=2)
    assert done[VICTIM].error is not None and stage in done[VICTIM].error and "injected fault" in done[VICTIM].error
    for i, want in enumerate(expected):
        if i != 2:
            assert done[f"r{i}"].error is None and done[f"r{i}"].outputs[0].token_ids == want, i
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.requests


def test_a_detokenizer_fault_midway_fails_only_that_request(llm, reference, monkeypatch):
    """After a few tokens (blocks held, decode running), the victim's detokenizer raises."""
    _, prompts, expected = reference("llama")
    original = IncrementalDetokenizer.add_token
    calls = {"n": 0}

    def add_token(self, token):
        if self is victim_detok[0]:
            calls["n"] += 1
            if calls["n"] == 5:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
        return original(self, token)

    victim_detok = [None]
    monkeypatch.setattr(IncrementalDetokenizer, "add_token", add_token)
    engine = llm.engine
    original_add = engine.add_request

    def add_request(rid, *args, **kwargs):
        original_add(rid, *args, **kwargs)
        if rid == VICTIM:
            victim_detok[0] = engine.requests[rid].seqs[0].detokenizer
    monkeypatch.setattr(engine, "add_request", add_request)
    done = _run(engine, prompts, MAX_TOKENS, victim_index=0)
    assert calls["n"] == 5 and "UnicodeDecodeError" in done[VICTIM].error
    assert all(done[f"r{i}"].outputs[0].token_ids == expected[i] for i in range(1, len(prompts)))
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_a_beam_search_fault_fails_only_that_search(llm, reference, monkeypatch):
    _, prompts, expected = reference("llama")
    original = BeamGroup.advance

    def advance(self, beam_tokens):
        if self.num_prompt_tokens == len(prompts[1]):
            raise OverflowError("injected fault")
        return original(self, beam_tokens)
    monkeypatch.setattr(BeamGroup, "advance", advance)
    engine = llm.engine
    done = _run(engine, prompts[:4], MAX_TOKENS[:4], victim_index=1, beam=True)
    assert "advancing its beam search" in done[VICTIM].error
    assert all(done[f"r{i}"].outputs[0].token_ids == expected[i] for i in (0, 2, 3))
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks and not engine.scheduler.running


def test_length_normalized_saturates():
    assert length_normalized(-3.0, 5, 1.0) == -3.0 / 5
    assert length_normalized(-3.0, 5, 1e308) == 0.0 and length_normalized(-3.0, 5, -1e308) == float("-inf")
    assert length_normalized(0.0, 5, -1e308) == 0.0
    with pytest.raises(ValueError, match="length_penalty must be finite"):
        BeamSearchParams(2, 4, float("nan"))


def test_sampling_params_refuse_what_no_tensor_holds():
    for kwargs, field in (({"top_k": 2**63}, "top_k"), ({"max_tokens": 2**64}, "max_tokens"),
                          ({"stop_token_ids": list(range(2000))}, "stop_token_ids"),
                          ({"logit_bias": {1: float("inf")}}, "logit_bias"), ({"temperature": float("inf")},
                                                                              "temperature")):
        with pytest.raises(ValueError, match=f"^{field} must"):
            SamplingParams(**kwargs)
    assert SamplingParams(top_k=2**62).top_k == 2**62  # above the vocabulary: every token (clamped when sampling)


# ---- the reported killers, over HTTP -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir, max_model_len=64, num_gpu_blocks_override=64)
    yield srv
    srv.stop()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
KILLERS = [
    ("/v1/chat/completions", {**CHAT, "top_k": 2**64}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "top_k": 2**63}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stop_token_ids": [2**64]}, 400, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stop_token_ids": [1] * 5000}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, "n": 2,
                         "length_penalty": 1e308}, 200, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, "n": 2,
                         "length_penalty": -1e308}, 200, None),
    ("/v1/chat/completions", {**CHAT, "top_k": 10**6}, 200, None),  # above the vocabulary: clamped, as in vLLM
]


@pytest.mark.parametrize("path,body,status,param", KILLERS)
def test_reported_killers_leave_the_engine_serving(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
    assert server.async_engine.status == "ready"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.post(server.base_url + "/chat/completions", json=CHAT, timeout=60).status_code == 200
