"""Grammar compiles run off the engine thread, in a bounded pool, with size and time limits.

A compile is held on an event (the condition an expensive schema creates, forced): while it is held the
engine schedules and finishes everyone else, the held request is never scheduled, and over HTTP a
bystander chat and /v1/engine/state answer; a compile past the time limit, or a schema past the node or
depth limit, is a 400 "too complex" naming the limit; a full pool is a 503.
"""
from __future__ import annotations

import threading

import httpx
import pytest

from engine.entrypoints.llm import LLM
from engine.sample.sampling_params import SamplingParams
from engine.entrypoints.openai import structured
from engine.structured_output import compiler as compiler_module
from engine.structured_output.compiler import (MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, GrammarCompiler,
                                               GrammarCompilerBusy, GrammarTooComplex)
from engine.structured_output.params import StructuredOutputsParams
from server_harness import start_server

HELD = "(held)+"  # the regex whose compile waits on the gate


@pytest.fixture()
def gate(monkeypatch):
    """Compiles of HELD wait until the gate opens; records the thread every compile ran on."""
    opened, threads = threading.Event(), []
    original = GrammarCompiler._compile

    def compile_(self, params):
        threads.append(threading.current_thread().name)
        if (params.regex or "").startswith(HELD):
            assert opened.wait(60), "the test never opened the gate"
        return original(self, params)
    monkeypatch.setattr(GrammarCompiler, "_compile", compile_)
    yield opened, threads
    opened.set()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), device="cpu", max_model_len=64, num_gpu_blocks_override=32, seed=0)


def test_the_step_never_waits_on_a_compile(llm, gate):
    opened, threads = gate
    engine = llm.engine
    held = SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(regex=HELD))
    engine.add_request("held", [5, 6, 7], held)
    for i in range(3):
        engine.add_request(f"r{i}", [8 + i, 9, 10], SamplingParams(temperature=0, max_tokens=4))
    finished, steps = set(), 0
    while len(finished) < 3:
        steps += 1
        assert steps < 200
        outputs = engine.step()
        assert all(o.request_id != "held" for o in outputs)
        assert all(s.request.request_id != "held" for s in engine.scheduler.running + list(engine.scheduler.waiting))
        finished |= {o.request_id for o in outputs if o.finished}
    assert [s.request.request_id for s, _ in engine.compiling] == ["held"]
    assert engine.get_stats().num_waiting == 1  # still counted as waiting
    opened.set()
    for _ in range(200):
        done = [o for o in engine.step() if o.finished]
        if done:
            break
    assert done[0].request_id == "held" and done[0].outputs[0].text.startswith("held")
    assert threads and all(t.startswith("pagedesk-grammar") for t in threads)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks and not engine.compiling


def test_an_aborted_compiling_request_leaves_nothing(llm, gate):
    engine = llm.engine
    held = SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(regex=HELD + "x"))
    engine.add_request("gone", [5, 6], held)
    engine.abort_request("gone")
    engine.step()
    assert not engine.compiling and not engine.requests


def test_the_cache_key_is_canonical(llm):
    grammars = llm.engine.grammars
    grammars.compile(StructuredOutputsParams(json_object=True))  # the engine's start-up compile, done before we count
    for future in list(grammars._pending.values()):  # earlier tests' held compiles finish once their gate opens
        future.exception(60)
    before = grammars.num_compiles
    a = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    b = StructuredOutputsParams(json={"required": ["k"], "properties": {"k": {"type": "integer"}}, "type": "object"})
    assert grammars.compile(a) is grammars.compile(b) and grammars.num_compiles == before + 1
    assert a.canonical_key == b.canonical_key
    # Property names are the one order that is kept: it is the order the output is generated in.
    two = {"r": {"type": "string"}, "a": {"type": "integer"}}
    c = StructuredOutputsParams(json={"type": "object", "properties": two})
    d = StructuredOutputsParams(json={"type": "object", "properties": dict(reversed(two.items()))})
    assert c.canonical_key != d.canonical_key and '"r"' in c.key[1].split('"a"')[0]


def test_size_and_depth_limits_name_the_limit(llm):
    wide = {"enum": list(range(MAX_SCHEMA_NODES))}
    with pytest.raises(GrammarTooComplex, match=f"{MAX_SCHEMA_NODES} schema nodes"):
        llm.engine.grammars.submit(StructuredOutputsParams(json=wide))
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"anyOf": [deep]}
    with pytest.raises(GrammarTooComplex, match=f"deeper than {MAX_SCHEMA_DEPTH} levels"):
        llm.engine.grammars.submit(StructuredOutputsParams(json=deep))


def test_a_full_pool_refuses_new_specs(llm, gate, monkeypatch):
    monkeypatch.setattr(compiler_module, "MAX_PENDING_COMPILES", 1)
    grammars = llm.engine.grammars
    held = grammars.submit(StructuredOutputsParams(regex=HELD + "y"))
    assert grammars.submit(StructuredOutputsParams(regex=HELD + "y")) is held  # the same spec shares it
    with pytest.raises(GrammarCompilerBusy):
        grammars.submit(StructuredOutputsParams(regex="other"))
    gate[0].set()
    held.result(30)


# ---- over HTTP ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir, max_model_len=64, num_gpu_blocks_override=64)
    yield srv
    srv.stop()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_bystanders_answer_while_compiles_are_held(server, gate, monkeypatch):
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 60.0)
    opened, _ = gate
    results = []

    def held_request(i):
        body = {**CHAT, "structured_outputs": {"regex": HELD + "z" * i}}
        results.append(httpx.post(server.base_url + "/chat/completions", json=body, timeout=90).status_code)
    senders = [threading.Thread(target=held_request, args=(i,)) for i in range(4)]  # more than the pool's threads
    for t in senders:
        t.start()
    try:
        for _ in range(3):
            assert httpx.post(server.base_url + "/chat/completions", json=CHAT, timeout=60).status_code == 200
            assert httpx.post(server.base_url + "/chat/completions", timeout=60, json={
                **CHAT, "response_format": {"type": "json_object"}}).status_code == 200
        assert httpx.get(server.base_url + "/engine/state", timeout=60).status_code == 200
        assert not results  # every held request is still waiting on its compile
    finally:
        opened.set()
        for t in senders:
            t.join(90)
    assert results == [200] * 4


def test_a_compile_past_the_time_limit_is_400_too_complex(server, gate, monkeypatch):
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.3)
    r = httpx.post(server.base_url + "/chat/completions", json={**CHAT, "guided_regex": HELD + "t"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    assert "too complex" in r.json()["error"]["message"] and "0.3 s limit" in r.json()["error"]["message"]
    assert httpx.post(server.base_url + "/chat/completions", json=CHAT, timeout=60).status_code == 200


def test_a_huge_schema_is_400_too_complex(server):
    wide = {"enum": list(range(MAX_SCHEMA_NODES))}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": wide}}}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "too complex" in r.json()["error"]["message"]
    assert str(MAX_SCHEMA_NODES) in r.json()["error"]["message"]


# ---- issue 34: the pool's share of the CPU, grammars that match nothing, special tokens quietly refused ----------

def test_compiles_run_at_a_lower_cpu_priority(llm, monkeypatch):
    """A grammar bomb must never put a bystander's step behind it: the pool's threads are COMPILE_NICE nicer than
    the process, so the scheduler gives the engine's step the CPU first (xgrammar drops the interpreter lock)."""
    import os
    seen = []
    original = GrammarCompiler._compile_spec

    def spy(self, params):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return original(self, params)
    monkeypatch.setattr(GrammarCompiler, "_compile_spec", spy)
    llm.engine.grammars.compile(StructuredOutputsParams(regex="(nice)+[0-9]"))
    assert seen and seen[0] == min(19, os.getpriority(os.PRIO_PROCESS, 0) + compiler_module.COMPILE_NICE)


def test_a_grammar_that_matches_nothing_is_400(server):
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={**CHAT, "structured_outputs": {"regex": "[^\\s\\S]"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert "matches no text" in r.json()["error"]["message"]


def test_special_tokens_are_refused_without_a_warning_line_each(capfd, caplog):
    """xgrammar writes a warning line for every special token it refuses (a speculative draft proposes them
    often): the state refuses them first, and a refused sampled token is logged once a minute, not each time."""
    import xgrammar as xgr

    from engine.structured_output import state as state_module
    from engine.structured_output.state import GrammarState
    info = xgr.TokenizerInfo(["a", "b", "", "c", "<eos>"], stop_token_ids=[4])
    assert info.special_token_ids == [2]
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_regex("[ab]+")
    state_module._refusals.update(last=float("-inf"), quiet=0)
    state = GrammarState(compiled)
    assert not state.try_accept(2) and state.try_accept(0)
    with caplog.at_level("WARNING", logger="pagedesk.engine"):
        for _ in range(50):
            assert not GrammarState(compiled).accept(2)
    assert "cannot accept special token" not in capfd.readouterr().err
    assert len([r for r in caplog.records if "refused by its request's grammar" in r.message]) == 1
