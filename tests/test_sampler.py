"""Sampler and stop rules: filters never emit excluded tokens, penalties match a direct computation,
seeded requests ignore their batch, stop strings and UTF-8 splits come out right."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sample.sampler import SamplingRow, apply_penalties, sample


def row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), [1, 2, 3, 3, 4], 2, None, [0])


def test_top_k_top_p_min_p_never_emit_excluded_tokens():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    top5 = set(order[:5].tolist())
    cum = probs[order].cumsum(0)
    nucleus = set(order[:int((cum < 0.6).sum()) + 1].tolist())
    above_min_p = set((probs >= 0.2 * probs.max()).nonzero()[:, 0].tolist())
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        assert sample(logits, [row(temperature=1.0, top_k=5)], gen).token_ids[0] in top5
        assert sample(logits, [row(temperature=1.0, top_p=0.6)], gen).token_ids[0] in nucleus
        assert sample(logits, [row(temperature=1.0, min_p=0.2)], gen).token_ids[0] in above_min_p


def test_penalties_match_direct_computation():
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, -0.5, 2.0]])
    r = row(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    got = logits.clone()
    apply_penalties(got, [r])
    want = logits.clone()[0]
    for t in {1, 2, 3, 4}:  # prompt [1, 2] + output [3, 3, 4]
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    counts = {3: 2, 4: 1}
    for t, c in counts.items():
        want[t] -= 0.25 * c + 0.5
    assert torch.allclose(got[0], want)


def test_logit_bias_and_min_tokens_mask():
    logits = torch.zeros(1, 8)
    r = SamplingRow(SamplingParams(temperature=0, logit_bias={5: 10.0}), [1], 1, None, [0])
    assert sample(logits, [r], torch.Generator()).token_ids == [5]
    logits = torch.tensor([[0.0, 0, 0, 9, 0, 0, 0, 0]])
    r = SamplingRow(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]), [1], 1, None, [0])
    assert sample(logits, [r], torch.Generator()).token_ids != [3]


def test_bitmask_allows_only_its_tokens():
    from engine.sample.state import SamplingMetadata
    logits = torch.randn(2, 70) * 3
    rows = [row(temperature=0), row(temperature=1.0)]
    meta = SamplingMetadata.build(rows, 70, logits.device)
    allowed = [{37}, {3, 63, 69}]
    bits = torch.zeros(2, 3, dtype=torch.int64)  # packed like xgrammar: bit j of word w allows token 32 w + j
    for i, tokens in enumerate(allowed):
        for t in tokens:
            bits[i, t // 32] |= 1 << (t % 32)
    meta.bitmask = bits.to(torch.int32)  # bit 31 wraps to the sign bit, as in int32 bitmasks
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        out = sample(logits, meta, gen)
        assert out.token_ids[0] == 37 and out.token_ids[1] in allowed[1]


def test_every_row_of_a_mixed_batch_samples_as_if_alone():
    """One vectorized pass over rows with different filters, penalties and seeds = each row on its own."""
    torch.manual_seed(0)
    kinds = [dict(temperature=0), dict(temperature=0.8, top_k=4, seed=1), dict(temperature=1.0, top_p=0.5, seed=2),
             dict(temperature=1.2, min_p=0.3, seed=3),
             dict(temperature=0, repetition_penalty=1.8, presence_penalty=1.0),
             dict(temperature=0.7, frequency_penalty=2.0, logit_bias={6: 4.0}, seed=4), dict(temperature=1.0, seed=5)]
    logits = torch.randn(len(kinds), 40) * 2

    def rows():
        return [SamplingRow(SamplingParams(**k), [1, 2, 3, 3, 4], 2,
                            torch.Generator().manual_seed(k["seed"]) if "seed" in k else None, [0]) for k in kinds]

    batch, alone_rows = rows(), rows()
    for _ in range(10):
        together = sample(logits, batch, torch.Generator())
        for i, r in enumerate(alone_rows):
            alone = sample(logits[i:i + 1], [r], torch.Generator())
            assert (alone.token_ids[0], alone.logprobs[0]) == (together.token_ids[i], together.logprobs[i])


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), device="cpu", seed=0)


def test_host_argmax_is_torch_s_on_ties_nan_and_greedy_rows():
    """numpy's argmax on the CPU's float32 logits (sampler.host_argmax_applies) gives torch's ids: the first of
    equal maxima, a NaN as the maximum; greedy rows with and without logprobs come out the same under a dispatch
    mode (torch's path) as without it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine.sample.sampler import host_argmax_applies

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(5)
    logits = torch.randn(6, 300)
    logits[1, 7] = logits[1, 250] = 99.0  # a tie: the first wins
    logits[2] = 1.0  # every token equal
    logits[3, 40] = float("nan")
    logits[4, 41] = float("inf")
    assert host_argmax_applies(logits) and not host_argmax_applies(logits.double())
    assert torch.equal(torch.from_numpy(logits.numpy().argmax(axis=-1)), logits.argmax(dim=-1))
    rows = [row(temperature=0.0, logprobs=k) for k in (None, 0, 2, None, 1, None)]
    host = sample(logits, rows, torch.Generator().manual_seed(0))
    with Watch():
        assert not host_argmax_applies(logits)
        reference = sample(logits, rows, torch.Generator().manual_seed(0))
    assert host.token_ids == reference.token_ids == logits.argmax(dim=-1).tolist()



def test_seed_is_independent_of_batch_composition(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24)
    alone = llm.generate(["Hello there"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = ["Hello there", "another prompt", "a third one that is longer than the rest of them", "x"]
    params = [seeded] + [SamplingParams(temperature=1.0, max_tokens=30)] * 3
    in_batch = llm.generate(crowd, params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == in_batch


def test_parallel_sampling_seeded_is_reproducible_and_distinct(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16)
    a = [o.token_ids for o in llm.generate(["Once upon"], params, use_tqdm=False)[0].outputs]
    b = [o.token_ids for o in llm.generate(["Once upon"], params, use_tqdm=False)[0].outputs]
    assert a == b and len({tuple(x) for x in a}) == 3


def test_logprobs_of_chosen_and_top_tokens(llm):
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for token, step in zip(comp.token_ids, comp.logprobs):
        assert token in step and step[token].rank == 1  # greedy picks the most likely token
        assert 3 <= len(step) <= 4
        assert max(lp.logprob for lp in step.values()) == step[token].logprob
    assert comp.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in zip(comp.token_ids, comp.logprobs)))


def test_stop_string_is_cut_and_reported(llm):
    params = dict(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    text = llm.generate(["The quick"], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
    at = next(i for i in range(2, len(text) - 2) if text[i:i + 2] not in text[:i + 1])
    stop = text[at:at + 2]
    out = llm.generate(["The quick"], SamplingParams(**params, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    free = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_id = free.token_ids[4]
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id],
                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(stop_id)
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id


def test_utf8_split_across_tokens_never_leaves_replacement_char(llm):
    tok = llm.get_tokenizer()
    text = "Emoji: 🚀🔥✨ 👍 Ça coûte"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the test really splits characters
    from engine.core.detokenizer import IncrementalDetokenizer
    detok = IncrementalDetokenizer(tok, SamplingParams(), 0)
    pieces = [detok.add_token(i) for i in ids]
    detok.flush()
    assert detok.text == text and "\ufffd" not in "".join(pieces)


def test_bad_requests_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**6]], SamplingParams(), use_tqdm=False)
    assert llm.generate(["still serving"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
