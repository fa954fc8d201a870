"""The persistent sampling state (engine/sample/state.py): a step with no joins or leaves writes only its new
tokens' counts, the buffers always equal counts rebuilt from the rows over a random join / grow / leave run,
the sampler's output is the same as from metadata built from the rows alone (seeded rows included), and a
pinned host buffer is only rewritten after the copy issued from it (CopyFence), and a step walks only
the rows that bias or mask tokens."""
from __future__ import annotations

import random

import numpy as np
import torch

from engine.worker.input_batch import InputBatch

from engine.platform.host_copies import CopyFence
from engine.sample.sampler import sample_on_device
from engine.sample.metadata import SamplingRow
from engine.sample.state import SamplingMetadata
from engine.sample.sampling_params import SamplingParams
from engine.sample.state import SamplingState
from engine.core.scheduler import ScheduledSeq
from test_input_batch import fake_seq

VOCAB = 40
CPU = torch.device("cpu")
KINDS = [dict(temperature=0, repetition_penalty=1.3), dict(temperature=0.9, top_k=5, presence_penalty=0.5, seed=1),
         dict(temperature=1.1, top_p=0.7, frequency_penalty=0.4, seed=2), dict(temperature=0.8, min_p=0.1),
         dict(temperature=0)]


def make_row(key: int, kind: dict, rng: random.Random) -> SamplingRow:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    gen = torch.Generator().manual_seed(kind["seed"]) if "seed" in kind else None
    return SamplingRow(SamplingParams(**kind), prompt, len(prompt), gen, [0], key)


def reference_counts(row: SamplingRow) -> tuple[np.ndarray, np.ndarray]:
    in_prompt = np.zeros(VOCAB, bool)
    in_prompt[row.prompt_ids] = True
    return in_prompt, np.bincount(row.output_ids, minlength=VOCAB).astype(np.int32)


def test_a_step_without_joins_writes_only_the_new_tokens():
    rng = random.Random(0)
    rows = [make_row(k, KINDS[k % 3], rng) for k in range(4)]  # the first three kinds are penalized
    for r in rows:
        r.token_ids += [rng.randrange(VOCAB) for _ in range(3)]
    state = SamplingState(VOCAB, CPU)
    state.metadata(rows)
    assert state.num_joined == 4 and state.num_count_writes == 4 * 3  # joined: the whole outputs
    for r in rows:
        r.token_ids.append(rng.randrange(VOCAB))
    meta = state.metadata(rows)
    assert state.num_joined == 0 and state.num_count_writes == 4  # one new token each, nothing rebuilt
    for i, r in enumerate(rows):
        slot = int(meta.penalty_slots[i])
        in_prompt, counts = reference_counts(r)
        assert (meta.in_prompt[slot].numpy() == in_prompt).all() and (meta.output_counts[slot].numpy() == counts).all()


def test_persistent_buffers_follow_random_joins_growth_and_leaves():
    rng = random.Random(3)
    state, live, next_key = SamplingState(VOCAB, CPU), [], 0
    for _ in range(20):
        for r in [r for r in live if rng.random() < 0.2]:  # finished or preempted: leaves
            live.remove(r)
        while len(live) < 6 and rng.random() < 0.6:
            live.append(make_row(next_key, rng.choice(KINDS), rng))
            next_key += 1
        for r in live:
            r.token_ids += [rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 1, 3]))]  # 3: a verify step
        if rng.random() < 0.1 and live:  # a row whose token list was replaced (a fork's own copy): rebuilt
            r = live[0]
            r.token_ids = list(r.token_ids)
        if not live:
            continue
        rng.shuffle(live)
        meta = state.metadata(live)
        fresh = SamplingMetadata.build(live, VOCAB, CPU)
        assert torch.equal(meta.temperature if meta.temperature is not None else torch.zeros(0),
                           fresh.temperature if fresh.temperature is not None else torch.zeros(0))
        pen = [i for i, r in enumerate(live) if r.params.repetition_penalty != 1.0 or r.params.presence_penalty
               or r.params.frequency_penalty]
        for j, i in enumerate(pen):
            slot = int(meta.penalty_slots[j])
            in_prompt, counts = reference_counts(live[i])
            assert (meta.in_prompt[slot].numpy() == in_prompt).all()
            assert (meta.output_counts[slot].numpy() == counts).all()
        logits = torch.randn(len(live), VOCAB, generator=torch.Generator().manual_seed(len(live)))
        state_rows = [state.rows[r.key] for r in live]
        assert len(set(state_rows)) == len(live) and max(state_rows) < 6  # holes reused, lowest first
        for r in live:  # the same draws: seeded rows restart their generators for both passes
            if r.generator is not None:
                r.generator.manual_seed(7)
        a = sample_on_device(logits.clone(), meta, torch.Generator().manual_seed(5))
        for r in live:
            if r.generator is not None:
                r.generator.manual_seed(7)
        b = sample_on_device(logits.clone(), fresh, torch.Generator().manual_seed(5))
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logprobs, b.logprobs)


class RecordingEvent:
    log: list[str] = []

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")


def test_a_pinned_host_table_is_rewritten_only_after_its_copy_ran(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", RecordingEvent)
    log = RecordingEvent.log = []
    ib = InputBatch(1, 4, CPU)
    ib.fence = CopyFence(True)  # as on a card: the host tables are pinned, the copies asynchronous
    write = ib._apply_write
    monkeypatch.setattr(ib, "_apply_write", lambda w: log.append("write") or write(w))
    from engine.kv.block_pool import Block
    seq = fake_seq([1, 2, 3], [[Block(1)]])
    ib.update([ScheduledSeq(seq, 3)])
    ib.commit()
    assert log == ["write", "record"]
    seq.block_tables[0].append(Block(2))
    ib.update([ScheduledSeq(seq, 1)])
    assert log == ["write", "record", "synchronize", "write"]  # the wait comes before the host write
    ib.update([ScheduledSeq(seq, 1)])  # nothing copied since: no wait
    assert log.count("synchronize") == 1
    off = CopyFence(False)  # on the CPU: nothing recorded, nothing waited for
    off.record()
    off.wait()
    assert off.event is None


def test_bias_and_masks_walk_only_the_rows_that_ask_and_match_a_walk_of_all():
    from engine.sample.state import bias_tensors, masked_tensors
    rng = random.Random(5)
    plain = [make_row(k, KINDS[k % len(KINDS)], rng) for k in range(4)]
    biased = SamplingRow(SamplingParams(logit_bias={3: 5.0, 7: -100.0}), [1, 2], 2, None, [0], 10)
    masked = SamplingRow(SamplingParams(min_tokens=2, stop_token_ids=[9]), [1, 2], 2, None, [0], 11)
    bad = SamplingRow(SamplingParams(), [1, 2, 4], 2, None, [0], 12)
    bad.params.bad_words_token_ids = [[4, 6], [8]]
    rows = [plain[0], biased, plain[1], masked, bad, plain[2], plain[3]]
    state = SamplingState(VOCAB, CPU)
    meta = state.metadata(rows)
    assert state.flags[[state.rows[r.key] for r in rows]][:, 3:].tolist() == [
        [False, False], [True, False], [False, False], [False, True], [False, True], [False, False], [False, False]]
    for got, full in ((meta.bias, bias_tensors(rows, CPU)), (meta.masked, masked_tensors(rows, CPU))):
        assert all(torch.equal(a, b) for a, b in zip(got, full))
    assert meta.bias[0].tolist() == [1, 1] and sorted(zip(*(t.tolist() for t in meta.masked))) == [
        (3, 0), (3, 9), (4, 6), (4, 8)]
    masked.token_ids += [5, 5]  # past min_tokens: nothing left to mask on that row
    bad.token_ids.append(5)  # no longer ends with the head of [4, 6]
    rows[1] = SamplingRow(SamplingParams(), biased.token_ids, 2, None, [0], 10)  # new parameters: no bias now
    meta = state.metadata(rows)
    assert meta.bias is None and sorted(zip(*(t.tolist() for t in meta.masked))) == [(4, 8)]


def test_a_step_of_the_same_rows_keeps_the_index_and_remakes_only_the_masks():
    """Decode after decode with the same rows in the same order: the index and parameter tensors are the last
    step's (no join, no new parameters), token masks follow the tokens, and the sampler draws what it draws from
    metadata built from the rows alone; a new order, or new parameters, builds them again."""
    rng = random.Random(9)
    rows = [make_row(k, KINDS[k % len(KINDS)], rng) for k in range(5)]
    rows.append(SamplingRow(SamplingParams(temperature=0.7, min_tokens=2, stop_token_ids=[9], logit_bias={3: 1.0}),
                            [1, 2], 2, torch.Generator().manual_seed(4), [0], 20))
    state = SamplingState(VOCAB, CPU)
    first = state.metadata(rows)
    for step in range(4):
        for r in rows:
            r.token_ids.append(rng.randrange(VOCAB))
        meta = state.metadata(rows)
        assert meta.sampled_rows is first.sampled_rows and meta.temperature is first.temperature  # kept
        fresh = SamplingMetadata.build(rows, VOCAB, CPU)
        assert (meta.masked is None) == (fresh.masked is None) == (step >= 1)  # min_tokens reached after 2 tokens
        if meta.masked is not None:
            assert all(torch.equal(a, b) for a, b in zip(meta.masked, fresh.masked))
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(step))
        draws = []
        for m in (meta, fresh):
            for r in rows:
                if r.generator is not None:
                    r.generator.manual_seed(3)
            draws.append(sample_on_device(logits.clone(), m, torch.Generator().manual_seed(1)))
        assert torch.equal(draws[0].token_ids, draws[1].token_ids) and torch.equal(draws[0].logprobs, draws[1].logprobs)
    assert state.metadata(rows[::-1]).sampled_rows is not first.sampled_rows  # another order: built again
    rows[0] = SamplingRow(SamplingParams(temperature=0.5), rows[0].token_ids, 2, None, [0], rows[0].key)
    again = state.metadata(rows[::-1])
    assert state.num_rewritten == 1 and again.temperature is not None and len(again.temperature) == 5
