"""Speculative decoding (engine/spec_decode): greedy output identical to no speculation with n-gram and
draft-model proposals (plain, chunked prefill + preemption + prefix caching, n>1, penalties / bad_words /
min_tokens / logit bias per position, a JSON-schema grammar), a copy of the target as draft accepted on
every draft token, stop strings and max_tokens cut inside an accepted run, an aborted request frees its
blocks, configuration errors name the field (exit 2 from pagedesk-serve), a draft model under TP=2 matches,
and the GUI's planner counts the draft as the engine does."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from engine import LLM, SamplingParams
from engine.kv.block_pool import hash_block
from engine.entrypoints.serve import main as serve_main
from engine.config.speculative import parse_speculative_config
from engine.structured_output.params import StructuredOutputsParams
from hf_reference import make_prompts

pytestmark = pytest.mark.timeout(300)
K = 2


def ngram_config():
    return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def prompts():
    """Random prompts with repeats inside them, so n-gram lookups find something; the first two are the
    same (the second hits the first's blocks in the prefix cache)."""
    base = make_prompts(400, seed=3)
    long = base[4] + base[2] + base[4][:12]
    return [long, long, base[2] + base[2][:8], base[1]]


def greedy_params():
    return [SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.3, presence_penalty=0.4),
            SamplingParams(temperature=0, max_tokens=13, n=2, min_tokens=6, logit_bias={7: 1.5, 9: -2.0}),
            SamplingParams(temperature=0, max_tokens=12, bad_words=["the", "ing"], frequency_penalty=0.3),
            SamplingParams(temperature=0, max_tokens=15)]


def token_ids(llm: LLM, params=None, ps=None) -> list[list[list[int]]]:
    outs = llm.generate(ps or prompts(), params or greedy_params(), use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def engines(llama_dir):
    made = {}

    def get(name: str) -> LLM:
        if name not in made:
            spec = {"ngram": ngram_config(), "draft": {"model": str(llama_dir), "num_speculative_tokens": K},
                    "base": None}[name.split("-")[0]]
            kwargs = {}
            if name.endswith("-stress"):  # chunks of 24 tokens, a pool small enough to preempt, prefix caching
                kwargs = dict(max_num_batched_tokens=24, num_gpu_blocks_override=9, max_num_seqs=5)
            made[name] = LLM(str(llama_dir), device="cpu", speculative_config=spec, **kwargs)
        return made[name]
    return get


@pytest.fixture(scope="module")
def expected(engines):
    return token_ids(engines("base"))


@pytest.mark.parametrize("name", ["ngram", "draft", "ngram-stress", "draft-stress"])
def test_greedy_identical_to_no_speculation(engines, expected, name):
    llm = engines(name)
    stats = llm.engine.spec.stats
    before_drafts, before_preempt = stats.num_draft_tokens, llm.engine.scheduler.num_preemptions
    assert token_ids(llm) == expected
    assert stats.num_draft_tokens > before_drafts  # it did speculate
    assert llm.engine.kv.prefix_hits > 0
    if name.endswith("-stress"):
        assert llm.engine.scheduler.num_preemptions > before_preempt
    if name.startswith("ngram"):
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_copy_of_target_as_draft_accepts_everything(engines):
    llm = engines("draft")
    stats = llm.engine.spec.stats
    for params in ([SamplingParams(temperature=0, max_tokens=12)] * 4,
                   [SamplingParams(temperature=1.0, max_tokens=12, seed=i) for i in range(4)]):
        drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        token_ids(llm, params, prompts()[2:4] * 2)
        assert stats.num_draft_tokens - drafted > 20
        assert stats.num_accepted_tokens - accepted >= 0.99 * (stats.num_draft_tokens - drafted)


class Point(BaseModel):
    x: int = Field(ge=-99, le=99)
    label: str = Field(max_length=6)


def test_json_schema_grammar_identical(engines):
    so = StructuredOutputsParams(json=Point.model_json_schema())
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=so)] * 2
    ps = ["Point: ", "The quick brown fox jumps over the lazy dog. Point: "]
    expected = token_ids(engines("base"), params, ps)
    for name in ("ngram", "draft"):
        assert token_ids(engines(name), params, ps) == expected


def test_stop_string_and_max_tokens_inside_an_accepted_run(engines):
    """The copy draft accepts all K drafts: tokens arrive K + 1 per step, so these cuts fall inside a run."""
    base, spec = engines("base"), engines("draft")
    prompt = prompts()[3]
    [ref] = base.generate([prompt], SamplingParams(temperature=0, max_tokens=14), use_tqdm=False)
    text = ref.outputs[0].text
    stop = text[len(text) // 3: len(text) // 3 + 3]
    for params in (SamplingParams(temperature=0, max_tokens=14, stop=[stop]),
                   SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=0, max_tokens=6),
                   SamplingParams(temperature=0, max_tokens=14, stop_token_ids=[ref.outputs[0].token_ids[8]])):
        [want] = base.generate([prompt], params, use_tqdm=False)
        [got] = spec.generate([prompt], params, use_tqdm=False)
        w, g = want.outputs[0], got.outputs[0]
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (w.text, w.token_ids, w.finish_reason,
                                                                         w.stop_reason)
    assert len(g.token_ids) <= 10 and g.finish_reason == "stop"


def test_abort_mid_run_frees_every_block(engines):
    engine = engines("ngram").engine
    engine.add_request("gone", prompts()[2], SamplingParams(temperature=0, max_tokens=100))
    drafted = engine.spec.stats.num_drafts
    for _ in range(20):  # past the prompt's blocks, with drafts verified (some rejected) on the way
        engine.step()
    assert engine.spec.stats.num_drafts > drafted
    assert engine.kv.pool.num_free_blocks < engine.kv.pool.num_blocks
    [seq] = engine.requests["gone"].seqs
    bs = engine.kv.block_size
    # Only blocks full of accepted tokens are in the prefix cache, under the hash of those tokens.
    assert 0 < seq.num_cached_blocks <= (seq.num_computed_tokens + 1) // bs
    for i, block in enumerate(seq.block_table[:seq.num_cached_blocks]):
        assert block.block_hash is not None
        assert seq.block_hashes[i] == hash_block(seq.block_hashes[i - 1] if i else None,
                                                 seq.token_ids[i * bs:(i + 1) * bs], None)
    engine.abort_request("gone")
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.scheduler.running and not engine.has_unfinished_requests()


def test_beam_search_and_prompt_logprobs_run_without_drafts(engines):
    llm = engines("ngram")
    stats = llm.engine.spec.stats
    drafted = stats.num_drafts
    [out] = llm.generate([prompts()[3]], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1),
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8 and stats.num_drafts == drafted


@pytest.mark.parametrize("raw, field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "bogus", "num_speculative_tokens": 2}, "method"),
    ({"method": "eagle3", "num_speculative_tokens": 1}, "method"),
    ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "unknown field"),
    ({"num_speculative_tokens": 2}, "method"),
    ('{"method": "ngram",', "JSON"),
])
def test_config_errors_name_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        parse_speculative_config(raw)


def test_serve_exits_2_on_a_bad_config(llama_dir, capsys):
    code = serve_main(["--model", str(llama_dir), "--device", "cpu",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    assert code == 2
    assert "speculative_config.num_speculative_tokens" in capsys.readouterr().err


def test_draft_with_another_vocabulary_is_refused(tiny_model_dir, llama_dir):
    other = tiny_model_dir("qwen2", vocab_size=300)
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary"):
        LLM(str(llama_dir), device="cpu", speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_draft_model_under_tensor_parallel_matches(llama_dir, engines, expected):
    """TP=2 over gloo: the draft model runs whole on rank 0 and its drafts travel in the step's input ids, as
    n-gram drafts do (the same path: one TP test covers both); rank 0 alone verifies them. The draft knows no
    penalties, so the penalised requests reject some drafts: rollback under TP too."""
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=2,
              speculative_config={"model": str(llama_dir), "num_speculative_tokens": K})
    try:
        assert token_ids(llm) == expected
        stats = llm.engine.spec.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        # Whole on rank 0: the weights of the unsharded target, more than rank 0's shard of it.
        whole = engines("base").engine.runner.weights_bytes()
        assert llm.engine.spec.proposer.runner.weights_bytes() == whole > llm.engine.runner.weights_bytes()
    finally:
        llm.engine.shutdown()


def test_logprobs_per_emitted_token_match(engines):
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=2)]
    ps = prompts()[2:3]
    [want] = engines("base").generate(ps, params, use_tqdm=False)
    [got] = engines("ngram").generate(ps, params, use_tqdm=False)
    w, g = want.outputs[0], got.outputs[0]
    assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == 10
    assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
    for a, b in zip(g.logprobs, w.logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert (a[t].rank, a[t].decoded_token) == (b[t].rank, b[t].decoded_token)
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_config_as_dict_round_trips_through_the_command_line():
    from engine.config.flags import flags_to_argv
    from engine.entrypoints.serve import parse_config

    spec = ngram_config()
    argv = flags_to_argv({"speculative_config": spec})
    config = parse_config(["--model", "m", *argv])
    assert parse_speculative_config(config.speculative_config) == parse_speculative_config(spec)


def test_only_layers_that_cannot_roll_back_are_refused():
    """Attention KV rolls back by not counting rejected slots, a hybrid's state group by replaying the
    accepted tokens (tests/test_spec_decode_hybrid.py); any other kind of layer is refused."""
    from types import SimpleNamespace

    from engine.spec_decode.loading import check_rollback

    group = lambda kind: SimpleNamespace(spec=SimpleNamespace(kind=kind))  # noqa: E731
    check_rollback(SimpleNamespace(groups=[group("full_attention"), group("sliding_window")]))
    check_rollback(SimpleNamespace(groups=[group("full_attention")], state=object()))  # the hybrid layout
    with pytest.raises(ValueError, match="speculative_config.*mamba.*cannot roll back"):
        check_rollback(SimpleNamespace(groups=[group("full_attention"), group("mamba")]))


def test_planner_counts_the_draft_as_the_engine_does(engines, llama_dir):
    """The GUI's planner line (app/capacity.py) with the form's speculative_config plans the pool the engine
    with that draft allocated: its KV page per block shares the budget, its weights are counted."""
    import json

    from app.capacity import capacity_line, plan_for
    from engine.planning.weights import rope_table_bytes

    config = json.loads((llama_dir / "config.json").read_text())
    values = {"max_num_seqs": 256, "speculative_config": json.dumps({"model": str(llama_dir),
                                                                     "num_speculative_tokens": K})}
    _, plan = plan_for(config, values, [])
    _, alone = plan_for(config, {"max_num_seqs": 256}, [])
    engine = engines("draft").engine
    assert plan.num_blocks == engine.kv.pool.num_blocks == alone.num_blocks // 2  # a copy: half the pages each
    # The draft's parameters as the engine measured them, plus its RoPE table (a buffer, not a parameter).
    assert plan.weights_bytes == alone.weights_bytes + engine.spec.proposer.runner.weights_bytes() + \
        rope_table_bytes(engine.spec.proposer.runner.config)
    missing = {**values, "speculative_config": {"model": str(llama_dir / "nowhere"), "num_speculative_tokens": K}}
    assert "speculative_config.model" in capacity_line(config, missing, [])
