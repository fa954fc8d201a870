"""Speculative decoding on hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet state slots beside the KV
cache): greedy output with n-gram drafts and with a draft model identical to the same engine without
speculation, plain and again from the prefix cache (cached_tokens > 0), with chunked prefill and forced
preemption, with n = 2; seeded sampling the same alone and in a batch. The draft model is an unrelated
tiny Llama, so most drafts are rejected, and the n-gram drafts are accepted only in part: the state slots
must be rolled back (engine/spec_decode/state_rollback.py), which the acceptance counters prove happened.
The verify + replay kernels themselves are checked in tests/test_gated_delta_torch.py and
tests/test_gated_delta_triton.py."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv.kv_cache_interface import model_kv_layout
from hf_reference import make_prompts

pytestmark = pytest.mark.timeout(300)
K = 3


def ngram_config():
    return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def prompts():
    """Prompts with repeats inside them (n-gram lookups find drafts); the first two are the same (44
    tokens: the second hits the first's snapshot when chunks keep them apart); the last one's output
    settles into a loop that n-gram drafts partly predict."""
    base = make_prompts(400, seed=3)
    long = base[4] + base[2] + base[4][:12]
    return [long, long, base[2] + base[2][:8], base[1]]


def greedy_params():
    return [SamplingParams(temperature=0, max_tokens=10), SamplingParams(temperature=0, max_tokens=9, n=2),
            SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0, max_tokens=14)]


def run(llm: LLM, params=None, ps=None):
    outs = llm.generate(ps or prompts(), params or greedy_params(), use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], outs


@pytest.fixture(scope="module")
def engines(tiny_model_dir, llama_dir):
    made = {}

    def get(arch: str, name: str) -> LLM:
        if (arch, name) not in made:
            spec = {"ngram": ngram_config(), "draft": {"model": str(llama_dir), "num_speculative_tokens": K},
                    "base": None}[name.split("-")[0]]
            kwargs = {}
            if name.endswith("-stress"):  # 16-token chunks inside the prompts, a pool small enough to preempt
                kwargs = dict(max_num_batched_tokens=16, num_gpu_blocks_override=7, max_num_seqs=4)
            made[arch, name] = LLM(str(tiny_model_dir(arch)), device="cpu", speculative_config=spec, **kwargs)
        return made[arch, name]
    return get


@pytest.fixture(scope="module")
def expected(engines):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = run(engines(arch, "base"))[0]
        return cache[arch]
    return get


def assert_no_state_held(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.state.pool.held() == set(kv.snapshots.values()) and not kv.pending_state_copies
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


@pytest.mark.parametrize("arch,name", [("qwen3_5", "ngram"), ("qwen3_5", "draft"), ("qwen3_next", "ngram"),
                                       ("qwen3_5", "ngram-stress")])
def test_greedy_identical_to_no_speculation(engines, expected, arch, name):
    llm = engines(arch, name)
    stats = llm.engine.spec.stats
    got, outs = run(llm)
    assert got == expected(arch)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens  # drafts rejected
    if name == "ngram":
        assert stats.num_accepted_tokens > 0  # and some accepted: replays of 1 + a tokens, a > 0
    if name.endswith("-stress"):  # chunked, preempted, and the repeated prompt restored from a state snapshot
        assert llm.engine.scheduler.num_preemptions > 0 and outs[1].num_cached_tokens > 0
    assert_no_state_held(llm)


def test_seeded_n_is_the_same_alone_and_in_a_batch(engines):
    llm = engines("qwen3_5", "ngram")
    runner, engine = llm.engine.runner, llm.engine  # the verify scratch: min(seats * (1 + k), token budget) rows
    assert runner.verify_states.max_rows == min(engine.config.max_num_seqs * (1 + K), engine.max_num_batched_tokens)
    layout = model_kv_layout(engine.model_config, engine.config.block_size, act_dtype_bytes=runner.dtype.itemsize)
    assert sum(layer.verify_scratch_bytes() for layer in runner.model.state_layers()) \
        == layout.verify_scratch_bytes(runner.verify_states.max_rows) > 0
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=8, n=2)
    alone, _ = run(llm, [seeded], prompts()[2:3])
    batch, _ = run(llm, [SamplingParams(temperature=0, max_tokens=8), seeded], prompts()[1:3])
    assert batch[1] == alone[0]
    assert_no_state_held(llm)


def test_ngram_under_tensor_parallel_2(tiny_model_dir, expected):
    """TP=2 over gloo: each rank keeps half the DeltaNet heads with their states and verify scratch; the
    replay of the accepted tokens travels in the step inputs, so both ranks roll back alike."""
    import torch.distributed as dist
    want = expected("qwen3_5")  # before the group exists: a one-rank engine built inside it would be sharded
    llm = LLM(str(tiny_model_dir("qwen3_5")), device="cpu", tensor_parallel_size=2, max_num_seqs=4,
              speculative_config=ngram_config())
    try:
        got, _ = run(llm)
        stats = llm.engine.spec.stats
        assert got == want and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()
