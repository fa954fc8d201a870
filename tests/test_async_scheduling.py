"""Async scheduling (--async-scheduling, issue 39): step N+1 is scheduled and prepared while step N runs, the
tokens step N sampled are fed to step N+1 on the device, stop rules that depend on them apply one step late, and
the output is identical to scheduling one step at a time — greedy, seeded sampling, stop strings and ids,
max_tokens, n > 1, preemption, and the requests that must run one step at a time (structured output, penalties,
speculative decoding). A device stand-in holds a step's results on an event: the next step's inputs are prepared
meanwhile. On a (fake) card the host makes no sync between one launch and the next.
"""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scheduler import ScheduledSeq
from engine.kv.block_pool import Block
from engine.sample.metadata import SamplingBatch
from engine.structured_output.params import StructuredOutputsParams
from engine.worker.step_inputs import PENDING_TOKEN
from test_fake_cuda import cuda_generator, fake_cuda, fake_runner, rows_for, tiny_weights  # noqa: F401
from test_input_batch import fake_seq

PROMPTS = ["The quick brown fox", "PagedAttention splits", "def main():", "Les élèves", "numbers 0 1 2 3",
           "Qwen, Llama and"]


def outputs(llm: LLM, prompts, params) -> list:
    """Everything a caller sees of each output: ids, text, why it ended, log-probs."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob is not None,
              None if c.logprobs is None else [sorted(step) for step in c.logprobs]) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def count_runs_ahead(llm: LLM) -> list[int]:
    """Steps whose successor was scheduled before their results came back (the scheduler's `launched`)."""
    seen, launched = [], llm.engine.scheduler.launched
    llm.engine.scheduler.launched = lambda out: seen.append(len(out.scheduled)) or launched(out)
    return seen


@pytest.fixture(scope="module")
def pair(llama_dir):
    """The same engine twice: one step at a time, and with async scheduling."""
    return [LLM(str(llama_dir), device="cpu", seed=0, async_scheduling=flag) for flag in (False, True)]


def same_both_ways(pair, prompts, params, ahead: bool = True) -> list:
    sync, ahead_llm = pair
    assert ahead_llm.engine.async_scheduling and not sync.engine.async_scheduling
    seen = count_runs_ahead(ahead_llm)
    want, got = outputs(sync, prompts, params), outputs(ahead_llm, prompts, params)
    assert got == want
    assert bool(seen) == ahead, f"{len(seen)} steps ran ahead"
    return want


def test_greedy_and_max_tokens(pair):
    params = [SamplingParams(temperature=0, max_tokens=3 + 7 * i) for i in range(len(PROMPTS))]
    same_both_ways(pair, PROMPTS, params)


def test_seeded_sampling_with_filters_and_logprobs(pair):
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=11 + i, max_tokens=24,
                             logprobs=2 if i % 2 else None) for i in range(len(PROMPTS))]
    same_both_ways(pair, PROMPTS, params)


def test_stop_strings_and_stop_ids_found_one_step_late(pair):
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    sync = pair[0]
    params = []
    for i, out in enumerate(sync.generate(PROMPTS, free, use_tqdm=False)):
        text, tokens = out.outputs[0].text, out.outputs[0].token_ids
        if i % 2:
            at = next(j for j in range(2, len(text) - 2) if text[j:j + 2] not in text[:j + 1])
            params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True,
                                         stop=[text[at:at + 2]], include_stop_str_in_output=i % 4 == 1))
        else:
            params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True,
                                         stop_token_ids=[tokens[len(tokens) // 2]]))
    got = same_both_ways(pair, PROMPTS, params)
    assert all(o[0][2] == "stop" for o in got)  # every one ended on its stop, not on max_tokens


def test_parallel_sampling_forks_then_runs_ahead(pair):
    params = [SamplingParams(n=3, temperature=1.0, seed=7 + i, max_tokens=12 + i) for i in range(3)]
    same_both_ways(pair, PROMPTS[:3], params)


def test_structured_output_and_penalties_run_one_step_at_a_time(pair):
    """Their next step needs this step's tokens on the host (the grammar accepts them; penalties count them):
    every step that holds one of them waits for its results, the others' output is the same either way."""
    so = StructuredOutputsParams(json_object=True)
    params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=20, bad_words=["the"], min_tokens=3)]
    same_both_ways(pair, PROMPTS[:3], params, ahead=False)
    mixed = params[:1] + [SamplingParams(temperature=0, max_tokens=40)]  # runs ahead once the grammar's is done
    same_both_ways(pair, PROMPTS[:2], mixed)


def test_preemption_under_a_tiny_pool(llama_dir):
    """12 blocks of 16 tokens for four running requests of 60 tokens and more: sequences are preempted (some with
    a token on its way) and recomputed."""
    common = dict(device="cpu", num_gpu_blocks_override=12, max_num_seqs=4)
    pair = [LLM(str(llama_dir), async_scheduling=flag, **common) for flag in (False, True)]
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True) for _ in PROMPTS]
    same_both_ways(pair, PROMPTS, params)
    assert pair[1].engine.scheduler.num_preemptions > 0


def test_speculative_decoding_keeps_one_step_at_a_time(llama_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    pair = [LLM(str(llama_dir), device="cpu", speculative_config=spec, async_scheduling=flag) for flag in (0, 1)]
    assert not pair[1].engine.async_scheduling  # drafts are proposed from the host's tokens
    params = [SamplingParams(temperature=0, max_tokens=30) for _ in PROMPTS]
    assert outputs(pair[0], PROMPTS, params) == outputs(pair[1], PROMPTS, params)


def test_an_abort_while_a_step_is_on_the_device(pair):
    llm = pair[1]
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("stays", PROMPTS[0], params)
    engine.add_request("goes", PROMPTS[1], params)
    for _ in range(4):
        engine.step()
    assert engine.inflight is not None
    engine.abort_request("goes")
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["stays"] and len(done[0].outputs[0].token_ids) == 50
    want = pair[0].generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert done[0].outputs[0].token_ids == want
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks  # every block back (cached ones count)


class HeldOutput:
    """A launched step whose results the device stand-in holds until its event is set."""

    def __init__(self, out, gate: threading.Event) -> None:
        self.out, self.gate = out, gate

    def result(self):
        assert self.gate.wait(60), "the held step was never released"
        return self.out.result()


def test_the_next_step_is_prepared_while_the_device_holds_this_one(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", async_scheduling=True)
    engine, runner = llm.engine, llm.engine.runner
    gates, prepared = [], []
    launch, prepare = runner.launch, runner.prepare

    def holding_launch(*args, **kwargs):
        out = launch(*args, **kwargs)
        gates.append(threading.Event())
        return HeldOutput(out, gates[-1])

    def watched_prepare(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        prepared.append((len(gates), [g.is_set() for g in gates], inputs))
        return inputs

    runner.launch, runner.prepare = holding_launch, watched_prepare
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("r", PROMPTS[0], params)
    assert engine.step() == []  # the prompt's step is launched; nothing has come back yet
    results = []
    stepping = threading.Thread(target=lambda: results.append(engine.step()))
    stepping.start()
    stepping.join(0.5)
    # The decode after the prompt was scheduled, prepared and launched while the prompt's results were held.
    assert stepping.is_alive() and len(gates) == 2 and not gates[0].is_set()
    launched_before, released, inputs = prepared[-1]
    assert launched_before == 1 and released == [False]
    assert inputs.input_ids.tolist() == [PENDING_TOKEN] and inputs.pending_rows.tolist() == [0]
    assert inputs.pending_sources.tolist() == [0]  # the prompt step's one sampled row, read on the device
    gates[0].set()
    stepping.join(60)
    (first,) = results[0]
    assert len(first.outputs[0].token_ids) == 1 and not first.finished
    for gate in gates:
        gate.set()
    got = list(first.outputs[0].token_ids)
    while engine.has_unfinished_requests():
        for gate in gates:
            gate.set()
        for out in engine.step():
            got = list(out.outputs[0].token_ids)
    want = LLM(str(llama_dir), device="cpu").generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def test_a_sequence_at_its_length_limit_is_not_scheduled_while_its_last_token_is_on_its_way(pair):
    llm = pair[1]
    engine = llm.engine
    engine.add_request("short", PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    scheduled = []
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        scheduled.append([item.num_new_tokens for item in out.scheduled])
        return out

    engine.scheduler.schedule = watched
    while engine.has_unfinished_requests():
        engine.step()
    del engine.scheduler.schedule
    # The prompt, then one decode; its second token was on its way when the third step was scheduled.
    assert scheduled[:2] == [[len(engine.tokenizer.encode(PROMPTS[0]))], [1]] and scheduled[2:] == [[]] * len(
        scheduled[2:])


@pytest.mark.fake_cuda
def test_no_host_sync_between_launches_on_a_card(tiny_weights, fake_cuda, monkeypatch):  # noqa: F811
    """Two launches on a fake card, the second feeding the first one's sampled tokens on the device: no host sync
    happens until the first step's results are read, and then one copy each."""
    runner = fake_runner(monkeypatch, fake_cuda, tiny_weights, torch.float16)
    state = {"phase": "launch", "syncs": []}

    def watch(name, original, blocking=lambda *a, **k: True):
        def wrapper(*args, **kwargs):
            if state["phase"] == "launch" and blocking(*args, **kwargs):
                state["syncs"].append(name)
            return original(*args, **kwargs)
        return wrapper

    def to_card_blocking(self, *args, **kwargs):
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        return (device is not None and torch.device(device).type == "cuda" and self.device.type == "cpu"
                and not kwargs.get("non_blocking", False))

    on_card = lambda t: t.device.type == "cuda"  # noqa: E731
    monkeypatch.setattr(torch.cuda, "synchronize", watch("synchronize", lambda *a, **k: None))
    monkeypatch.setattr(torch.Tensor, "item", watch("item", torch.Tensor.item, on_card))
    monkeypatch.setattr(torch.Tensor, "cpu", watch("cpu", torch.Tensor.cpu, on_card))
    tolist = torch._subclasses.fake_tensor.FakeTensor.tolist
    monkeypatch.setattr(torch._subclasses.fake_tensor.FakeTensor, "tolist", watch("tolist", tolist, on_card))
    monkeypatch.setattr(torch.Tensor, "to", watch("blocking copy to the card", torch.Tensor.to, to_card_blocking))
    blocks = [Block(i) for i in range(1, 8)]
    a = fake_seq([1, 2, 3], [[blocks[0]]])
    b = fake_seq([4, 5, 6, 7, 8], [[blocks[1], blocks[2]]], computed=4)
    params = [SamplingParams(temperature=0.8, seed=2, top_k=5, logprobs=2), SamplingParams(temperature=0)]
    rows = rows_for(params, [cuda_generator(), None])
    for r, seq in zip(rows, (a, b)):
        r.key = seq.seq_id
    batch = SamplingBatch(rows, logits_index=[0, 1], generator=cuda_generator())
    first = runner.launch([ScheduledSeq(a, 3), ScheduledSeq(b, 1)], [(1, 5)], batch)
    for seq in (a, b):  # what the scheduler's `launched` does: computed now, one token on its way
        seq.num_computed_tokens = len(seq.token_ids)
    second_batch = [ScheduledSeq(a, 1, num_pending=1), ScheduledSeq(b, 1, num_pending=1)]
    second = runner.launch(second_batch, [], SamplingBatch(rows, logits_index=[0, 1], generator=cuda_generator()))
    assert state["syncs"] == [] and fake_cuda.host_copies == 0
    state["phase"] = "results"
    assert len(first.result().sampled.token_ids) == 2 and len(second.result().sampled.token_ids) == 2
    assert fake_cuda.host_copies == 2  # one packed copy per step


def test_pending_tokens_are_fed_from_the_last_steps_samples_on_the_device(llama_dir):
    """The runner's own bookkeeping: the ids the device writes in are the ones the last step sampled."""
    llm = LLM(str(llama_dir), device="cpu", async_scheduling=True)
    runner = llm.engine.runner
    runner.last_sampled = torch.tensor([41, 42, 43])
    inputs = SimpleNamespace(input_ids=np.array([7, PENDING_TOKEN, 9, PENDING_TOKEN]),
                             pending_rows=np.array([1, 3]), pending_sources=np.array([2, 0]))
    assert runner._fed_input_ids(inputs).tolist() == [7, 43, 9, 41]


def test_streams_through_the_server_are_the_same(llama_dir):
    """The async engine's thread steps an engine that runs ahead: the streamed text and ids are the same."""
    import httpx
    from server_harness import MODEL_NAME, start_server

    got = []
    for flag in (False, True):
        server = start_server(llama_dir, async_scheduling=flag)
        try:
            assert server.async_engine.engine.async_scheduling is flag
            body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True,
                    "stop": None}
            pieces = []
            with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        pieces.append(json.loads(line[5:])["choices"][0]["text"])
            got.append("".join(pieces))
        finally:
            server.stop()
    assert got[0] == got[1] and got[0]
