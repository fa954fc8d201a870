"""Structured outputs inside the engine: grammars survive preemption (recompute), prefix-cache hits and n>1
forks, every output validates, a grammar that reached its end stops the sequence, and the bitmask packs
exactly the allowed ids and masks logits on their own device."""
from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel, Field

from engine.entrypoints.llm import LLM
from engine.sample.sampling_params import SamplingParams
from engine.sample.sampler import apply_token_bitmask
from engine.structured_output.bitmask import allocate_bitmask
from engine.structured_output.params import StructuredOutputsParams


class Point(BaseModel):
    x: int = Field(ge=-99, le=99)
    label: str = Field(max_length=6)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # 10 blocks of 16 tokens for 8 sequences of ~50 tokens: the scheduler must preempt and recompute.
    return LLM(str(tiny_model_dir("qwen2")), device="cpu", max_model_len=128, num_gpu_blocks_override=10,
               max_num_seqs=8, seed=0)


def test_outputs_validate_under_preemption_prefix_caching_and_forks(llm):
    so = StructuredOutputsParams(json=Point.model_json_schema())
    prompt = "The quick brown fox jumps over the lazy dog. PagedAttention"  # shared: prefix-cache hits
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=60, seed=i, structured_outputs=so) for i in range(4)]
    outputs = llm.generate([prompt] * 4, params, use_tqdm=False)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
    for out in outputs:
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            Point.model_validate_json(c.text)


def test_grammar_end_stops_even_with_ignore_eos(llm):
    so = StructuredOutputsParams(choice=["alpha", "beta"])
    [out] = llm.generate(["pick:"], SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True,
                                                  structured_outputs=so), use_tqdm=False)
    assert out.outputs[0].text in ("alpha", "beta") and out.outputs[0].finish_reason == "stop"


def test_bad_spec_is_a_value_error(llm):
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", grammar='root ::= "a"')


def test_allowed_token_ids_with_and_without_a_grammar(llm):
    allowed = list(range(40, 90))
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                                    allowed_token_ids=allowed),
                                     SamplingParams(temperature=1.0, max_tokens=12, allowed_token_ids=allowed,
                                                    structured_outputs=StructuredOutputsParams(regex="[a-z]+"))],
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 12 and set(outs[0].outputs[0].token_ids) <= set(allowed)
    grammar_ids = [t for t in outs[1].outputs[0].token_ids if t not in llm.engine.model_config.eos_token_ids]
    assert set(grammar_ids) <= set(allowed)


def test_bitmask_masks_exactly_the_disallowed_ids():
    vocab = 70
    bitmask = allocate_bitmask(2, vocab)
    allowed = [0, 31, 32, 33, 63, 64, 69]
    bitmask[1] = 0
    for token in allowed:
        bitmask[1, token // 32] |= torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)
    logits = torch.randn(2, vocab)
    before = logits.clone()
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits[0], before[0])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == allowed


def test_bitmask_applies_on_the_logits_device():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        logits = torch.empty(3, 100, device="cuda")
        bitmask = allocate_bitmask(3, 100)
        apply_token_bitmask(logits, bitmask.to(logits.device))  # a CPU/CUDA mix would raise here
        assert logits.device.type == "cuda"


def test_tensor_parallel_grammar_and_prompt_logprobs(tiny_model_dir, llm):
    """Rank 0 samples under the grammar and reduces the prompt rows; the worker joins every LM-head gather."""
    so = StructuredOutputsParams(json=Point.model_json_schema())
    prompt = "numbers 0 1 2 3 4 5 6 7 8 9 10"
    params = SamplingParams(n=2, temperature=1.0, max_tokens=60, seed=1, structured_outputs=so, prompt_logprobs=2)
    [single] = llm.generate([prompt], params, use_tqdm=False)
    tp = LLM(str(tiny_model_dir("qwen2")), device="cpu", tensor_parallel_size=2, max_model_len=128)
    try:
        [out] = tp.generate([prompt], params, use_tqdm=False)
    finally:
        tp.engine.shutdown()
    for c in out.outputs:
        Point.model_validate_json(c.text)
    for ours, ref in zip(out.prompt_logprobs[1:], single.prompt_logprobs[1:]):
        assert ours.keys() == ref.keys()
        assert all(abs(ours[t].logprob - ref[t].logprob) < 1e-4 for t in ours)


def test_structural_tag_in_vllms_form_constrains_only_inside_its_tags(llm):
    """vLLM's `structures`/`triggers` form: free text anywhere, but once a trigger opens a tag, JSON matching
    the tag's schema and then the tag's end."""
    import xgrammar as xgr
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    so = StructuredOutputsParams(structural_tag={"structures": [{"begin": "<f=get>", "schema": schema,
                                                                 "end": "</f>"}], "triggers": ["<f="]})
    compiled = llm.engine.grammars.compile(so)

    def accepts(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepts('any words <f=get>{"a": 12}</f> and more')
    assert not accepts('any words <f=get>{"a": "twelve"}')
    assert not accepts('<f=get>{"b": 1}')
    assert not accepts('<f=other>')  # a trigger must open one of the tags
