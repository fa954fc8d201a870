"""--max-batch-prefill-tokens: a step that decodes computes at most that many prompt tokens (summed over
running chunks and new admissions), decodes keep the whole budget, a step without decodes gives prompts the
whole budget, and greedy output is the same as without the cap."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.entrypoints import serve
from engine.config.flags import EngineConfig
from engine.kv.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sample.sampling_params import SamplingParams as Params
from engine.core.scheduler import Scheduler
from engine.core.sequence import Request, Sequence, SequenceStatus
from hf_reference import MAX_TOKENS, engine_greedy


def seq_of(name: str, tokens: list[int]) -> Sequence:
    return Sequence(Request(name, None, tokens, Params(temperature=0), None, 0.0), 0, tokens, None)


def decoding(kv: KVCacheManager, name: str, tokens: list[int]) -> Sequence:
    """A running sequence with every token but the last computed: its next step is a decode."""
    seq = seq_of(name, tokens)
    assert kv.allocate_slots(seq, len(tokens) - 1)
    seq.num_computed_tokens = len(tokens) - 1
    seq.status = SequenceStatus.RUNNING
    return seq


def prompt_tokens(out) -> int:
    return sum(item.num_new_tokens for item in out.scheduled if item.is_prefill)


def test_a_decoding_step_takes_at_most_the_cap_in_prompt_tokens_over_all_prompts():
    kv = KVCacheManager(num_blocks=200, block_size=4, enable_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=64, max_num_batched_tokens=512, enable_chunked_prefill=True,
                          max_batch_prefill_tokens=10)
    streams = [decoding(kv, f"d{i}", [i + 1] * 6) for i in range(40)]
    scheduler.running = list(streams)
    for name in ("a", "b", "c"):
        scheduler.add(seq_of(name, list(range(1, 30))))

    out = scheduler.schedule()

    assert sum(1 for item in out.scheduled if not item.is_prefill) == 40  # every stream decodes: no cut
    assert prompt_tokens(out) == 10 and [i.seq.request.request_id for i in out.scheduled if i.is_prefill] == ["a"]
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
    for stream in streams:
        stream.append_token(3, 0.0, None)
    out = scheduler.schedule()  # "a" is now a running chunk: it and any admission share the same 10
    assert prompt_tokens(out) == 10


def test_a_step_with_no_decode_gives_prompts_the_whole_budget():
    kv = KVCacheManager(num_blocks=200, block_size=4, enable_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=64, max_num_batched_tokens=100, enable_chunked_prefill=True,
                          max_batch_prefill_tokens=10)
    scheduler.add(seq_of("a", list(range(1, 80))))
    scheduler.add(seq_of("b", list(range(1, 80))))
    assert prompt_tokens(scheduler.schedule()) == 100


def test_greedy_output_is_the_same_with_the_cap(reference):
    path, prompts, expected = reference("llama")
    # three at a time, so the later prompts are admitted (5 tokens a step) while the first ones decode
    assert engine_greedy(path, prompts, MAX_TOKENS, max_num_batched_tokens=256, max_batch_prefill_tokens=5,
                         max_num_seqs=3) == expected


def test_long_prompt_is_fed_in_capped_chunks_while_a_stream_decodes(reference):
    path, prompts, _ = reference("llama")
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=512, max_batch_prefill_tokens=16)
    engine = llm.engine
    engine.add_request("short", prompts[2], SamplingParams(temperature=0, max_tokens=30))
    engine.step()
    engine.add_request("long", [7] * 200, SamplingParams(temperature=0, max_tokens=1))
    long_seq = engine.requests["long"].seqs[0]
    steps = 0
    while not long_seq.is_finished and steps < 100:
        before = long_seq.num_computed_tokens
        outs = {o.request_id for o in engine.step()}
        steps += 1
        assert "short" in outs
        assert long_seq.is_finished or long_seq.num_computed_tokens - before <= 16
    assert steps == -(-200 // 16)


def test_serving_defaults_cap_prompts_on_cpu_only():
    served = serve.parse_config(["--model", "m"])
    assert served.resolve_max_batch_prefill_tokens("cpu") == 32
    assert served.resolve_max_batch_prefill_tokens("cuda") is None
    assert EngineConfig(model="m").resolve_max_batch_prefill_tokens("cpu") is None  # offline: throughput
    assert serve.parse_config(["--model", "m", "--max-batch-prefill-tokens", "0"]) \
        .resolve_max_batch_prefill_tokens("cpu") is None
    assert serve.parse_config(["--model", "m", "--max-batch-prefill-tokens", "100"]) \
        .resolve_max_batch_prefill_tokens("cuda") == 100
    whole = serve.parse_config(["--model", "m", "--no-enable-chunked-prefill"])
    assert whole.resolve_max_batch_prefill_tokens("cpu") is None


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.integers(1, 60), min_size=1, max_size=8), arrivals=st.lists(st.integers(0, 6),
       min_size=8, max_size=8), cap=st.integers(1, 24), budget=st.integers(8, 64), blocks=st.integers(8, 40),
       caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       priorities=st.lists(st.integers(-2, 2), min_size=8, max_size=8), windows=st.sampled_from([(), (None, 6), (5,)]))
def test_scheduler_invariants_under_random_arrivals(prompts, arrivals, cap, budget, blocks, caching, policy,
                                                    priorities, windows):
    """Whatever arrives when, with a small pool (preemption), prefix caching on or off, either scheduling
    policy, one KV cache group or window groups beside a full one: a step stays within the budget, a step that
    decodes takes at most `cap` prompt tokens, and every request finishes."""
    specs = [FullAttentionSpec(4, 1, 1, 1) if w is None else SlidingWindowSpec(4, 1, 1, 1, w) for w in windows]
    kv = KVCacheManager(num_blocks=blocks * max(1, len(specs)), block_size=4, enable_caching=caching,
                        group_specs=specs or None)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, enable_chunked_prefill=True,
                          max_batch_prefill_tokens=cap, policy=policy)
    seqs = [seq_of(f"r{i}", [1 + (i + j) % 7 for j in range(n)]) for i, n in enumerate(prompts)]
    for seq, priority, arrival in zip(seqs, priorities, arrivals):
        seq.request.priority, seq.request.arrival_time = priority, float(arrival)
    outputs = {id(s): 0 for s in seqs}
    for step in range(2000):
        for i, seq in enumerate(seqs):
            if arrivals[i] == step:
                scheduler.add(seq)
        if step > max(arrivals) and not scheduler.has_work():
            break
        out = scheduler.schedule()
        assert out.num_tokens <= budget
        if any(not item.is_prefill for item in out.scheduled):
            assert prompt_tokens(out) <= cap
        finished = list(out.too_long)
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        for item in out.scheduled:
            seq = item.seq
            if seq.num_computed_tokens == seq.num_tokens:  # sampled: one more token, three per request
                if outputs[id(seq)] == 3:
                    seq.status = SequenceStatus.FINISHED
                    finished.append(seq)
                else:
                    outputs[id(seq)] += 1
                    seq.append_token(5, 0.0, None)
            item.seq.num_computed_tokens -= item.num_new_tokens  # update_from_output adds them back
        scheduler.update_from_output(out, [], finished)
    assert not scheduler.has_work(), "requests left unfinished"
    assert all(s.is_finished for s in seqs)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
