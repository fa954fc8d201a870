"""--scheduling-policy priority (vLLM's): waiting requests are admitted by (priority, arrival), lower first;
preemption takes the running sequence ranked last; greedy output does not depend on the order; the
default fcfs refuses a priority other than 0, in the engine and over HTTP."""
from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sample.sampling_params import SamplingParams as Params
from engine.core.scheduler import Scheduler
from engine.core.sequence import Request, Sequence, SequenceStatus
from hf_reference import MAX_TOKENS
from server_harness import MODEL_NAME, start_server


def seq_of(name: str, tokens: list[int], priority: int, arrival: float) -> Sequence:
    request = Request(name, None, tokens, Params(temperature=0), None, arrival, priority=priority)
    return Sequence(request, 0, tokens, None)


def names(seqs) -> list[str]:
    return [s.request.request_id for s in seqs]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64, enable_chunked_prefill=True,
                          policy="priority")
    for name, priority, arrival in (("a", 5, 1.0), ("b", 1, 2.0), ("c", 5, 0.5), ("d", 1, 3.0), ("e", -2, 4.0)):
        scheduler.add(seq_of(name, [1, 2, 3], priority, arrival))
    assert names(scheduler.waiting) == ["e", "b", "d", "c", "a"]
    assert names(item.seq for item in scheduler.schedule().scheduled) == ["e", "b"]  # max_num_seqs = 2


def test_fcfs_keeps_arrival_order():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    for name, arrival in (("a", 3.0), ("b", 1.0), ("c", 2.0)):
        scheduler.add(seq_of(name, [1, 2, 3], 0, arrival))
    assert names(scheduler.waiting) == ["a", "b", "c"]  # the order they were added in


def test_the_lowest_priority_running_sequence_is_preempted():
    def full_pool(policy: str):
        kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
        scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
                              policy=policy)
        for name, priority in (("low", 9), ("high", 0), ("mid", 3)):  # admitted in this order
            seq = seq_of(name, [1, 2, 3, 4, 5], priority, 0.0)
            assert kv.allocate_slots(seq, 4)
            seq.num_computed_tokens, seq.status = 4, SequenceStatus.RUNNING
            scheduler.running.append(seq)
        assert kv.allocate_slots(seq_of("filler", [9] * 4, 0, 0.0), 4)  # no free block: each decode needs one
        return scheduler

    scheduler = full_pool("priority")
    out = scheduler.schedule()
    assert names(item.seq for item in out.scheduled) == ["high"]  # "low" and then "mid" made room for it
    assert names(scheduler.waiting) == ["mid", "low"]
    fcfs = full_pool("fcfs")
    assert names(item.seq for item in fcfs.schedule().scheduled) == ["low"]  # the latest admitted went first


def test_greedy_output_does_not_depend_on_priorities(reference):
    path, prompts, expected = reference("llama")
    llm = LLM(str(path), device="cpu", scheduling_policy="priority", max_num_seqs=3)
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS)):
        llm.engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n), priority=(7 * i) % 5)
    done = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
    assert [done[i] for i in range(len(prompts))] == expected


def test_fcfs_refuses_a_priority(llama_dir):
    llm = LLM(str(llama_dir), device="cpu")
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        llm.engine.add_request("x", [5, 6], SamplingParams(max_tokens=1), priority=1)


def test_priority_over_http(llama_dir):
    for policy, ok in (("priority", True), ("fcfs", False)):
        server = start_server(llama_dir, scheduling_policy=policy)
        try:
            client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
            ask = dict(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"priority": -3})
            if ok:
                assert client.completions.create(**ask).choices[0].finish_reason == "length"
            else:
                with pytest.raises(openai.BadRequestError, match="priority"):
                    client.completions.create(**ask)
        finally:
            server.stop()
