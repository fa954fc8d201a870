"""The rejection sampler alone (engine/sample/rejection_sampler.py): its output distribution equals the
target's (seeded chi-square over many draws on a six-token vocabulary, for a draft model's q and for
deterministic n-gram drafts), greedy rows accept exactly while the draft is the argmax, and a draft equal
to the target is always accepted."""
from __future__ import annotations

import torch

from engine.sample.metadata import SamplingRow

from engine.sample.state import SamplingMetadata
from engine.sample.sampling_params import SamplingParams
from engine.spec_decode.proposers.ngram import NgramProposer
from engine.sample.rejection_sampler import rejection_sample

VOCAB = 6
DRAWS = 6000
CHI2_BOUND = 35.0  # df = 5: p < 1e-5 under the null, so a correct sampler with this fixed seed passes


def _meta(num_rows: int, params: SamplingParams) -> SamplingMetadata:
    rows = [SamplingRow(params, [0], 1, None, [])] * num_rows
    return SamplingMetadata.build(rows, VOCAB, torch.device("cpu"))


def _chi2(tokens: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = p.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def _verify_first_tokens(target_logits: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor,
                         gen: torch.Generator):
    """DRAWS sequences with one draft each: rows (draft, bonus) per sequence; the first emitted tokens."""
    logits = target_logits.repeat(2 * DRAWS, 1)
    meta = _meta(2 * DRAWS, SamplingParams(temperature=1.0))
    q_rows = None if q is None else q.repeat(DRAWS, 1)
    out = rejection_sample(logits, meta, [[int(d)] for d in drafts], gen, q_rows)
    return [t[0] for t in out.token_ids], out


def test_output_distribution_matches_target_with_a_draft_distribution():
    gen = torch.Generator().manual_seed(1234)
    target_logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0, -0.5])
    p = torch.softmax(target_logits, dim=-1)
    q = torch.softmax(torch.tensor([0.0, 2.0, 1.0, -1.0, 0.5, 0.0]), dim=-1)  # a poor draft
    drafts = torch.multinomial(q, DRAWS, replacement=True, generator=gen)
    first, out = _verify_first_tokens(target_logits, q, drafts, gen)
    assert _chi2(first, p) < CHI2_BOUND
    rate = sum(out.num_accepted) / DRAWS
    expected_rate = float(torch.minimum(p, q).sum())  # the acceptance probability of the rule
    assert abs(rate - expected_rate) < 0.03


def test_output_distribution_matches_target_with_deterministic_drafts():
    gen = torch.Generator().manual_seed(99)
    target_logits = torch.tensor([0.3, 1.5, -0.2, 0.8, 0.1, -1.0])
    p = torch.softmax(target_logits, dim=-1)
    drafts = torch.full((DRAWS,), 3)  # n-gram: always the same proposal, q one-hot
    first, out = _verify_first_tokens(target_logits, None, drafts, gen)
    assert _chi2(first, p) < CHI2_BOUND
    assert abs(sum(out.num_accepted) / DRAWS - float(p[3])) < 0.03


def test_draft_equal_to_target_is_always_accepted_and_the_bonus_follows():
    gen = torch.Generator().manual_seed(5)
    target_logits = torch.randn(3, VOCAB, generator=gen)  # three positions: two drafts, one bonus
    p = torch.softmax(target_logits, dim=-1)
    seqs = 300
    drafts = [[int(torch.multinomial(p[0], 1, generator=gen)), int(torch.multinomial(p[1], 1, generator=gen))]
              for _ in range(seqs)]
    out = rejection_sample(target_logits.repeat(seqs, 1), _meta(3 * seqs, SamplingParams(temperature=1.0)),
                           drafts, gen, p[:2].repeat(seqs, 1))
    assert out.num_accepted == [2] * seqs
    assert all(t[:2] == d and len(t) == 3 for t, d in zip(out.token_ids, drafts))


def test_greedy_accepts_while_the_draft_is_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 0, 0, 0, 0], [0, 0, 5.0, 0, 0, 0], [0, 0, 0, 5.0, 0, 0],
                           [5.0, 0, 0, 0, 0, 0]] * 3)
    meta = _meta(12, SamplingParams(temperature=0))
    drafts = [[1, 2, 3], [1, 4, 3], [0, 2, 3]]  # all right; wrong at 2; wrong at 1
    out = rejection_sample(logits, meta, drafts, None)
    assert out.num_accepted == [3, 1, 0]
    assert out.token_ids == [[1, 2, 3, 0], [1, 2], [1]]
    lp = torch.log_softmax(logits[0], dim=-1)[1].item()
    assert abs(out.logprobs[0][0] - lp) < 1e-6


def test_ngram_proposer_takes_the_latest_match_longest_first():
    proposer = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=1)
    assert proposer.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]) == [7, 8, 5]
    assert proposer.propose([5, 6, 7, 8, 4, 6, 7]) == [8, 4, 6]  # the 2-gram (6, 7)
    assert proposer.propose([1, 2, 3, 4]) == []
    assert proposer.propose([4, 1, 4], max_drafts=1) == [1]
    assert proposer.propose([1, 2, 1, 2], max_drafts=0) == []
