"""Expert-load statistics under speculative decoding (issue 32 item 6): a verify step routes every draft token
before the rejection sampler decides, and the rejected ones used to stay in the counts. Now they are taken back
out after verification (ExpertLoad.drop_rejected), so with n-gram drafts (many rejected on random weights) the
counts are exactly HF's router over the tokens each sequence fed, as without speculation."""
from __future__ import annotations

from engine import LLM, SamplingParams
from test_moe_expert_load import NUM_EXPERTS, TOP_K, fed, moe, reference_counts  # noqa: F401 (fixture)

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


def test_rejected_drafts_are_not_counted(moe):  # noqa: F811
    path, prompts, hf = moe
    prompts = [p * 3 for p in prompts]  # repeats give the n-gram proposer drafts to make
    llm = LLM(str(path), device="cpu", speculative_config=SPEC, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=12) for _ in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # some drafts kept, some rejected
    load = llm.engine.get_stats().expert_load
    want = reference_counts(hf, [fed(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)])
    assert load["tokens"] == want
    fed_tokens = sum(len(fed(p, o.outputs[0].token_ids)) for p, o in zip(prompts, outs))
    assert [sum(row) for row in load["tokens"]] == [fed_tokens * TOP_K] * 2
