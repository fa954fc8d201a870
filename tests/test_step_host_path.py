"""The host's part of a step (issue 39): the engine's step timer accounts for the step, and the shortcuts taken
per token give what the long way gives — the Rust tokenizer's decode, the sampler without a logits copy or a
full log_softmax, hidden states and logits read in place when a step's rows are the first ones, prefix-cache hashes
over known tokens only under async scheduling."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.core.detokenizer import decoder_of
from engine.core.step_timer import PHASES
from engine.sample.metadata import SamplingRow
from engine.sample.sampler import sample_on_device
from engine.sample.state import SamplingMetadata


def test_the_fast_decode_is_the_tokenizers_decode(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    fast = decoder_of(tok)
    assert fast is not tok.decode  # the tiny model's tokenizer cleans no spaces up: the Rust decode is taken
    rng = random.Random(0)
    ids = tok.encode("Les élèves étudient l'été. Emoji: 🚀🔥 <|im_start|> def main(): print('x')")
    ids += tok.all_special_ids
    for _ in range(300):
        window = [rng.choice(ids) for _ in range(rng.randint(1, 6))]
        for skip in (False, True):
            assert fast(window, skip_special_tokens=skip) == tok.decode(window, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir, clean_up_tokenization_spaces=True)
    assert decoder_of(tok) == tok.decode
    assert decoder_of(None) is None  # a test's sequence without a tokenizer


def test_the_step_timer_accounts_for_every_step(llama_dir):
    llm = LLM(str(llama_dir), device="cpu")
    engine = llm.engine
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        laps = engine.timer.laps
        assert set(laps) == set(PHASES) and all(v >= 0 for v in laps.values())
        assert laps["forward"] > 0 and laps["prepare"] > 0  # the runner lapped its own host work
        assert engine.timer.host_s == pytest.approx(engine.timer.step_s - laps["forward"])
    assert engine.timer.num_steps == steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_without_edits_match_the_full_path(dtype):
    """No copy of the logits and a logsumexp for the chosen tokens: the same ids, the same log-probs, as the path
    that edits a copy and takes the whole log_softmax (a bias of zero is an edit that changes nothing)."""
    torch.manual_seed(0)
    logits = (torch.randn(5, 300) * 4).to(dtype)
    before = logits.clone()
    rows = [SamplingRow(SamplingParams(temperature=0), [1, 2], 1, None, [0]) for _ in range(5)]
    plain = sample_on_device(logits, SamplingMetadata.build(rows, 300, logits.device), torch.Generator())
    edited = [SamplingRow(SamplingParams(temperature=0, logit_bias={7: 0.0}, logprobs=1), [1, 2], 1, None, [0])
              for _ in range(5)]
    full = sample_on_device(logits, SamplingMetadata.build(edited, 300, logits.device), torch.Generator())
    assert torch.equal(logits, before)  # the model's logits are never written
    assert torch.equal(plain.token_ids, full.token_ids)
    torch.testing.assert_close(plain.logprobs, full.logprobs, rtol=1e-5, atol=1e-5)


def test_rows_without_logprobs_need_no_logsumexp():
    """A caller that reads no logprob of rows that ask none (the engine) gets the same tokens without any, and
    the step runs no logsumexp over the vocabulary."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(temperature=0), [1, 2], 1, None, [0]) for _ in range(3)]
    meta = SamplingMetadata.build(rows, 300, logits.device)
    full = sample_on_device(logits, meta, torch.Generator())
    seen = []
    with Ops():
        lean = sample_on_device(logits, meta, torch.Generator(), chosen_logprobs=False)
        host = lean.to_host()
    assert seen == ["aten.max.dim"]  # the greedy reduction alone
    assert lean.logprobs is None and host.logprobs is None and host.token_ids == full.token_ids.tolist()


def test_cumulative_logprob_only_where_logprobs_are_asked(llama_dir):
    llm = LLM(str(llama_dir), device="cpu")
    asked, plain = llm.generate(["Hello", "Hello"], [SamplingParams(temperature=0, max_tokens=4, logprobs=0),
                                                     SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
    a, p = asked.outputs[0], plain.outputs[0]
    assert a.token_ids == p.token_ids and p.cumulative_logprob is None and p.logprobs is None
    assert a.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in zip(a.token_ids, a.logprobs)))


def test_async_scheduling_caches_the_same_prefix_blocks(llama_dir):
    """A block completed by a token still on the device is hashed once that token is known: a second request
    sharing the first's prompt and output hits as many cached tokens either way."""
    hits = []
    for flag in (False, True):
        llm = LLM(str(llama_dir), device="cpu", async_scheduling=flag, block_size=16)
        prompt = [5 + i for i in range(15)]  # the first decode's input fills the first block
        first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
        before = llm.engine.kv.prefix_hits
        llm.generate([prompt + first[:30]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        hits.append(llm.engine.kv.prefix_hits - before)
    assert hits[0] == hits[1] == 32


def test_a_narrow_top_k_keeps_what_the_full_sort_keeps():
    """Rows whose top-k are all narrow take a top-k that wide instead of sorting the vocabulary: the same tokens
    survive with the same probabilities (top-p and min-p applied within them)."""
    from engine.sample.sampler import filter_top_k_top_p_min_p
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, 1000) * 3, dim=-1)
    params = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_k=40, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=200, min_p=0.05), SamplingParams(temperature=1.0)]
    rows = [SamplingRow(p, [1, 2], 1, None, [0]) for p in params]
    meta = SamplingMetadata.build(rows[:3], 1000, probs.device)
    assert meta.filter_width == 200
    narrow = filter_top_k_top_p_min_p(probs[:3].clone(), meta)
    meta.filter_width = None  # the full sort
    full = filter_top_k_top_p_min_p(probs[:3].clone(), meta)
    torch.testing.assert_close(narrow, full, rtol=0, atol=0)
    assert [int((r > 0).sum()) for r in narrow][0] == 5
    assert SamplingMetadata.build(rows, 1000, probs.device).filter_width == 200  # unfiltered rows do not count
    top_p_only = rows + [SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), [1, 2], 1, None, [0])]
    assert SamplingMetadata.build(top_p_only, 1000, probs.device).filter_width == 1000  # no top-k: the sort


@pytest.mark.parametrize("scale", [8.0, 0.1], ids=["peaked", "flat"])
def test_top_p_on_the_cpu_looks_among_the_likeliest_first(scale):
    """A peaked distribution's top-p mass sits in the first TOP_P_GUESS tokens: no sort of the vocabulary, the same
    survivors; a flat one falls back to the sort."""
    from engine.sample import sampler
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(3, 4000) * scale, dim=-1)
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.5, min_p=0.01),
              SamplingParams(temperature=1.0, top_p=0.95)]
    meta = SamplingMetadata.build([SamplingRow(p, [1, 2], 1, None, [0]) for p in params], 4000, probs.device)
    sorts = []
    sort = torch.Tensor.sort
    torch.Tensor.sort = lambda self, *a, **k: sorts.append(1) or sort(self, *a, **k)
    try:
        got = sampler.filter_top_k_top_p_min_p(probs.clone(), meta)
    finally:
        torch.Tensor.sort = sort
    guess = sampler.TOP_P_GUESS
    sampler.TOP_P_GUESS = 4000  # never enough room for a guess: the sort
    try:
        want = sampler.filter_top_k_top_p_min_p(probs.clone(), meta)
    finally:
        sampler.TOP_P_GUESS = guess
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert bool(sorts) == (scale < 1)


def test_rows_read_in_place_when_they_are_the_first_rows():
    """A decode step's logits rows are its first token rows, and each sampling row reads its own logits row: the
    hidden states and the logits are read in place; otherwise gathered, with the same draws."""
    from types import SimpleNamespace

    from engine.sample.metadata import SamplingBatch
    from engine.worker.input_prep import logits_index
    from engine.worker.sampling import prepare_sampling, sample_prepared

    cpu = torch.device("cpu")
    assert logits_index(SimpleNamespace(logits_rows=[0, 1, 2]), cpu) == slice(0, 3)
    assert logits_index(SimpleNamespace(logits_rows=[4, 9]), cpu).tolist() == [4, 9]  # prompt chunks end later
    assert logits_index(SimpleNamespace(logits_rows=[]), cpu) is None
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5, seed=3)]

    def draw(index):
        rows = [SamplingRow(p, [1, 2], 2, torch.Generator().manual_seed(9) if p.seed else None, [0]) for p in params]
        prepared = prepare_sampling(SamplingBatch(rows, index, generator=torch.Generator().manual_seed(1)), 50, cpu)
        return prepared, sample_prepared(logits, prepared).sampled

    in_place, a = draw([0, 1])
    gathered, b = draw([1, 0])
    assert in_place.rows_index is None and gathered.rows_index.tolist() == [1, 0]
    assert a.token_ids[0] == int(logits[0].argmax())
    assert b.token_ids[0] == int(logits[1].argmax())
    _, c = draw([1, 1])  # two rows off one logits row (n > 1): gathered
    assert c.token_ids[0] == b.token_ids[0]


def test_async_decodes_of_the_same_batch_read_the_samples_in_place(llama_dir):
    """Decode after decode of the same sequences under async scheduling: the last step's sampled ids are this
    step's input ids as they are, no tensor made for them; the outputs are the synchronous engine's."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(llama_dir), device="cpu", async_scheduling=True)
    runner, fed = llm.engine.runner, []
    feed = runner._fed_input_ids
    runner._fed_input_ids = lambda inputs: fed.append((feed(inputs), runner.last_sampled)) or fed[-1][0]
    got = [o.outputs[0].token_ids for o in llm.generate(["a b", "c d e"], params, use_tqdm=False)]
    assert any(ids is sampled for ids, sampled in fed)
    want = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device="cpu").generate(["a b", "c d e"], params,
                                                                                       use_tqdm=False)]
    assert got == want
