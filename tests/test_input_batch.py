"""The persistent input batch (engine/worker/input_batch.py): a step writes only what changed, the tables always equal
the ones rebuilt from the sequences (over random join / grow / leave / preempt / fork / prefix-hit runs of the
real KV manager, full and sliding-window groups), a tensor-parallel mirror that applies the diffs holds the
same tables, and on a (fake) card the host makes no sync between the forward's launch and the sampler's one
result copy, on a step whose sampling rows join and on the next, which only counts their new tokens.
"""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.block_pool import Block
from engine.worker.input_batch import InputBatch
from engine.kv.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sample.metadata import SamplingBatch
from engine.sample.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import Sequence
from test_fake_cuda import CUDA, cuda_generator, fake_cuda, fake_runner, rows_for, tiny_weights  # noqa: F401

BS = 4
_ids = itertools.count(10_000)


class FakeSeq(SimpleNamespace):
    """What the KV manager and the input batch read of a Sequence."""

    mark_table_edit = Sequence.mark_table_edit

    @property
    def block_table(self):
        return self.block_tables[0]


def fake_seq(tokens: list[int], tables=None, computed: int = 0) -> FakeSeq:
    return FakeSeq(seq_id=next(_ids), token_ids=list(tokens), num_computed_tokens=computed,
                   block_tables=tables if tables is not None else [[]], block_hashes=[], table_edits={},
                   request=SimpleNamespace(cache_salt=None, params=SamplingParams(), pooling=None), num_cached_blocks=0,
                   num_tokens=len(tokens), num_prompt_tokens=len(tokens), params=SamplingParams())


def rebuilt(seqs, num_groups: int, width: int) -> np.ndarray:
    """[num_groups, num_seqs, width] tables from the sequences' block lists, zero-padded: the old way."""
    out = np.zeros((num_groups, len(seqs), width), dtype=np.int32)
    for i, seq in enumerate(seqs):
        for g, table in enumerate(seq.block_tables):
            out[g, i, :len(table)] = [b.block_id for b in table]
    return out



def test_a_step_that_changed_nothing_reuses_the_last_gathered_tables():
    """Issue 39: a decode inside its last block gathers no tables (no op); a new block, a left row or other rows
    gather afresh, and what they gather equals the sequences' tables."""
    blocks = [Block(i) for i in range(1, 40)]
    a = fake_seq([1] * 8, [[blocks[0], blocks[1]]], computed=8)
    b = fake_seq([1] * 12, [[blocks[2], blocks[3], blocks[4]]], computed=12)
    ib = InputBatch(1, 16, torch.device("cpu"))

    def step(*seqs):
        rows, _ = ib.update([ScheduledSeq(s, 1) for s in seqs])
        ib.commit()
        width = int(ib.num_blocks[:, rows].max())
        tables = ib.step_tables(rows, width)
        assert (tables.numpy() == rebuilt(seqs, 1, width)).all()
        return tables

    first = step(a, b)
    assert step(a, b) is first  # nothing changed: the same tensor
    b.block_tables[0].append(blocks[5])  # a new block: the commit drops the reuse
    second = step(a, b)
    assert second is not first and step(a, b) is second
    assert step(b) is not second  # a left: other rows (and its row zeroed)
    assert step(b, a) is not second

def test_a_growing_sequence_writes_only_its_new_block():
    blocks = [Block(i) for i in range(1, 40)]
    a = fake_seq([1] * 8, [[blocks[0], blocks[1]]], computed=8)
    b = fake_seq([1] * 12, [[blocks[2], blocks[3], blocks[4]]], computed=12)
    ib = InputBatch(1, 16, torch.device("cpu"))
    rows, diff = ib.update([ScheduledSeq(a, 1), ScheduledSeq(b, 1)])
    assert diff.num_written == 5 and diff.freed_rows == []
    ib.commit()
    b.block_tables[0].append(blocks[5])  # b's next decode crosses into a new block; a stays inside its last one
    rows2, diff = ib.update([ScheduledSeq(a, 1), ScheduledSeq(b, 1)])
    assert (rows2 == rows).all()
    assert [(w.row, w.group, w.start, w.block_ids.tolist()) for w in diff.writes] == [(rows[1], 0, 3, [6])]
    assert ib.dirty == [(0, rows[1], 3, 4)]  # one cell goes to the device
    ib.commit()
    assert ib.dirty == [] and ib.device_tables[0, rows[1], :4].tolist() == [3, 4, 5, 6]
    # Leaving: a's row is freed (zeroed); the next sequence takes the lowest hole.
    rows3, diff = ib.update([ScheduledSeq(b, 1)])
    assert diff.freed_rows == [rows[0]] and ib.host_np[0, rows[0]].sum() == 0
    c = fake_seq([1] * 4, [[blocks[9]]], computed=0)
    rows4, _ = ib.update([ScheduledSeq(b, 1), ScheduledSeq(c, 4)])
    assert rows4.tolist() == [rows[1], rows[0]]


def test_an_in_place_edit_rewrites_from_the_edited_entry():
    blocks = [Block(i) for i in range(1, 20)]
    a = fake_seq([1] * 8, [[blocks[0], blocks[1], blocks[2]]], computed=8)
    ib = InputBatch(1, 8, torch.device("cpu"))
    ib.update([ScheduledSeq(a, 1)])
    a.block_tables[0][2] = blocks[7]  # copy-on-write of the last block, as the manager does it
    a.mark_table_edit(0, 2)
    _, diff = ib.update([ScheduledSeq(a, 1)])
    assert [(w.start, w.block_ids.tolist()) for w in diff.writes] == [(2, [8])] and a.table_edits == {}


SPECS = {"full": [FullAttentionSpec(BS, 1, 1, 1)],
         "full+window": [FullAttentionSpec(BS, 1, 1, 1), SlidingWindowSpec(BS, 1, 1, 1, 6)]}


@pytest.mark.parametrize("layout", list(SPECS))
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_persistent_tables_equal_the_rebuilt_ones(layout, seed):
    rng = random.Random(seed)
    specs = SPECS[layout]
    kv = KVCacheManager(48, BS, True, specs)
    ib, mirror = InputBatch(len(specs), 32, torch.device("cpu")), InputBatch(len(specs), 32, torch.device("cpu"))
    live: list[FakeSeq] = []  # hold blocks; any may be scheduled in a step
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(4)]  # repeats: prefix hits
    for _ in range(30):
        op = rng.random()
        if op < 0.25 and len(live) < 8:  # join, maybe on a prefix hit
            seq = fake_seq(rng.choice(prompts))
            computed = kv.get_computed_blocks(seq)
            if kv.allocate_slots(seq, seq.num_tokens - len(computed) * BS, computed):
                seq.num_computed_tokens = seq.num_tokens
                live.append(seq)
        elif op < 0.35 and live:  # leave (finish) or be preempted (blocks freed; rejoins later from scratch)
            seq = live.pop(rng.randrange(len(live)))
            kv.free(seq)
            if rng.random() < 0.5:
                computed = kv.get_computed_blocks(seq)
                if kv.allocate_slots(seq, seq.num_tokens - len(computed) * BS, computed):
                    seq.num_computed_tokens = seq.num_tokens
                    live.append(seq)
        elif op < 0.45 and live and len(live) < 8:  # fork (n > 1, beams): shares the parent's blocks
            parent = rng.choice(live)
            child = fake_seq(parent.token_ids)
            kv.fork(parent, child)
            live.append(child)
        for seq in live:  # grow: a decode (copy-on-write of a shared partial block, window freeing included)
            if rng.random() < 0.7:
                seq.token_ids.append(rng.randrange(3))
                seq.num_tokens = len(seq.token_ids)
                if kv.allocate_slots(seq, 1):
                    seq.num_computed_tokens += 1
                else:
                    seq.token_ids.pop()
                    seq.num_tokens -= 1
        kv.take_copies()
        scheduled = [s for s in live if rng.random() < 0.8 and s.block_tables[0]]
        if not scheduled:
            continue
        rows, diff = ib.update([ScheduledSeq(s, 1) for s in scheduled])
        assert len(set(rows.tolist())) == len(rows)
        width = int(ib.num_blocks[:, rows].max())
        assert width == max(len(t) for s in scheduled for t in s.block_tables)
        expected = rebuilt(scheduled, len(specs), width)
        assert (ib.host_tables(rows, width) == expected).all()
        mirror.apply(diff)
        ib.commit()
        mirror.commit()
        assert (mirror.host_np == ib.host_np).all()
        assert (ib.gather(torch.from_numpy(rows), width).numpy() == expected).all()
        assert (mirror.gather(torch.from_numpy(rows), width).numpy() == expected).all()
        free = sorted(set(range(ib.num_rows)) - set(rows.tolist()))
        assert not ib.host_np[:, free].any()  # rows nobody owns are zero


def test_a_mirror_refuses_a_lost_diff():
    ib, mirror = InputBatch(1, 4, torch.device("cpu")), InputBatch(1, 4, torch.device("cpu"))
    seq = fake_seq([1], [[Block(3)]])
    ib.update([ScheduledSeq(seq, 1)])
    _, second = ib.update([ScheduledSeq(seq, 1)])
    with pytest.raises(RuntimeError, match="lost"):
        mirror.apply(second)


def test_a_table_longer_than_the_columns_is_a_clear_error():
    ib = InputBatch(1, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="3 entries does not fit the input batch's 2 columns"):
        ib.update([ScheduledSeq(fake_seq([1] * 12, [[Block(1), Block(2), Block(3)]]), 12)])


@pytest.mark.fake_cuda
def test_no_host_sync_between_the_forward_launch_and_the_sampler(tiny_weights, fake_cuda, monkeypatch):  # noqa: F811
    import engine.sample.sampler as sampler
    runner = fake_runner(monkeypatch, fake_cuda, tiny_weights, torch.float16)
    state = {"phase": "prepare", "syncs": []}

    def count(name, *args, **kwargs):
        if state["phase"] == "forward":
            state["syncs"].append(name)

    def watch(name, original, blocking=lambda *a, **k: True):
        def wrapper(*args, **kwargs):
            if blocking(*args, **kwargs):
                count(name)
            return original(*args, **kwargs)
        return wrapper

    def to_card_blocking(self, *args, **kwargs):
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        return (device is not None and torch.device(device).type == "cuda" and self.device.type == "cpu"
                and not kwargs.get("non_blocking", False))

    def on_card(device=None, **kwargs):
        return device is not None and torch.device(device).type == "cuda"

    monkeypatch.setattr(torch.cuda, "synchronize", watch("synchronize", lambda *a, **k: None))
    monkeypatch.setattr(torch.Tensor, "item", watch("item", torch.Tensor.item, lambda t: t.device.type == "cuda"))
    monkeypatch.setattr(torch.Tensor, "cpu", watch("cpu", torch.Tensor.cpu, lambda t: t.device.type == "cuda"))
    tolist = torch._subclasses.fake_tensor.FakeTensor.tolist
    monkeypatch.setattr(torch._subclasses.fake_tensor.FakeTensor, "tolist",
                        watch("tolist", tolist, lambda t: t.device.type == "cuda"))
    monkeypatch.setattr(torch.Tensor, "to", watch("blocking copy to the card", torch.Tensor.to, to_card_blocking))
    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, watch(f"torch.{name} on the card", original,
                                               lambda *a, device=None, **k: on_card(device)))
    forward, to_host = runner.model.forward, sampler.SampledTokens.to_host

    def launch(*args, **kwargs):
        state["phase"] = "forward"
        return forward(*args, **kwargs)

    def results(self):
        state["phase"] = "results"
        return to_host(self)

    monkeypatch.setattr(runner.model, "forward", launch)
    monkeypatch.setattr(sampler.SampledTokens, "to_host", results)
    blocks = [Block(i) for i in range(1, 8)]
    a = fake_seq([1, 2, 3], [[blocks[0]]])
    b = fake_seq([4, 5, 6, 7, 8], [[blocks[1], blocks[2]]], computed=4)
    params = [SamplingParams(temperature=0.8, seed=2, top_k=5, logprobs=2, repetition_penalty=1.2,
                             logit_bias={3: 1.0}, min_tokens=3),
              SamplingParams(temperature=0, presence_penalty=0.5)]
    rows = rows_for(params, [cuda_generator(), None])
    for r, seq in zip(rows, (a, b)):
        r.key = seq.seq_id  # persistent sampling rows: the second step takes the incremental path
    words = -(-runner.config.vocab_size // 32)
    for step in range(2):
        state["phase"] = "prepare"
        batch = SamplingBatch(rows, logits_index=[0, 1], generator=cuda_generator(),
                              bitmask=torch.full((2, words), -1, dtype=torch.int32))
        scheduled = [ScheduledSeq(a, 3 if step == 0 else 1), ScheduledSeq(b, 1)]
        out = runner.execute(scheduled, [(1, 5)] if step == 0 else [], batch)
        assert state["phase"] == "results" and len(out.sampled.token_ids) == 2
        assert state["syncs"] == []
        for seq, r in zip((a, b), rows):  # the step's token, as the output processor appends it
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(9)
            seq.num_tokens += 1
            r.token_ids.append(9)
    assert runner.sampling_state.num_joined == 0 and runner.sampling_state.num_count_writes == 2


@pytest.mark.parametrize("layout", list(SPECS))
def test_a_decode_step_takes_the_short_path_to_the_same_inputs(layout):
    """`prepare_decodes` (one-token decodes only) gives `prepare_any`'s StepInputs, field by field, step after step:
    decodes that cross into a new block, a sequence that leaves, one whose token is still on the device."""
    from engine.worker.input_prep import InputPreparer
    from engine.worker.step_inputs import StepInputs

    specs = SPECS[layout]
    kv = KVCacheManager(64, BS, False, specs)
    shape = SimpleNamespace(groups=specs, state=None)
    short, long = (InputPreparer(shape, BS, 128, torch.device("cpu")) for _ in range(2))
    seqs = [fake_seq([3] * n) for n in (5, 8, 2)]
    for seq in seqs:
        assert kv.allocate_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1  # the prompt ran; its last token is the next decode's input
    for step in range(7):
        if step == 4:
            seqs.pop(1)  # finished: its row is freed
        batch = [ScheduledSeq(s, 1) for s in seqs]
        if step == 5:  # async scheduling: the last token is on its way, fed on the device
            seqs[0].num_computed_tokens += 1
            batch[0].num_pending = 1
            for prep in (short, long):
                prep.last_sample_rows = {seqs[0].seq_id: 3}
        assert short.plain and all(i.num_new_tokens == 1 and not i.is_prefill for i in batch)
        edits = [dict(s.table_edits) for s in seqs]  # the KV manager's marks, read (and cleared) by each input batch
        fast = short.prepare(batch, [(1, 2)])
        for seq, marks in zip(seqs, edits):
            seq.table_edits.update(marks)
        slow = long.prepare_any(batch, [(1, 2)])
        for name in StepInputs.__slots__:
            a, b = getattr(fast, name), getattr(slow, name)
            if name == "table_diff":
                assert [(w.row, w.group, w.start, w.block_ids.tolist(), w.truncate) for w in a.writes] == \
                    [(w.row, w.group, w.start, w.block_ids.tolist(), w.truncate) for w in b.writes]
                assert (a.freed_rows, a.num_rows) == (b.freed_rows, b.num_rows)
            elif isinstance(b, np.ndarray):
                assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), name
            else:
                assert a == b, name
        for seq in seqs:  # each decode appends its token and takes the next slot
            if step != 5 or seq is not seqs[0]:
                seq.num_computed_tokens += 1
            seq.token_ids.append(4)
            seq.num_tokens = len(seq.token_ids)
            assert kv.allocate_slots(seq, 1)
