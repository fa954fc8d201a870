"""The step buffers (engine/worker/step_buffers.py): a step's inputs written in place, on the CPU without a torch op
once a batch size was seen, grown for a longer step, and on a card in two alternating sets, so the host buffer a
queued copy reads is never the one the next step writes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.worker.step_buffers import FIRST_CAPACITY, StepBuffers
from engine.worker.step_inputs import StepInputs
from test_fake_cuda import CUDA, fake_cuda  # noqa: F401


def decode_inputs(n: int, step: int, groups: int = 1) -> StepInputs:
    """n one-token decodes at positions step + i."""
    positions = np.arange(n, dtype=np.int64) + step
    slots = np.stack([positions + 100 * g for g in range(groups)])
    return StepInputs(
        input_ids=np.arange(n, dtype=np.int64) + 7 * step, positions=positions, slot_mapping=slots[0],
        seq_lens=(positions + 1).astype(np.int32), query_start_loc=np.arange(n + 1, dtype=np.int32),
        logits_rows=list(range(n)), max_query_len=1, max_seq_len=int(positions.max()) + 1, block_copies=[],
        group_slot_mappings=slots[1:] if groups > 1 else None)


def check(inputs: StepInputs, ids, positions, meta) -> None:
    assert ids.tolist() == inputs.input_ids.tolist() and positions.tolist() == inputs.positions.tolist()
    assert meta.slot_mapping.tolist() == inputs.slot_mapping.tolist()
    assert meta.seq_lens.tolist() == inputs.seq_lens.tolist() and meta.seq_lens.dtype == torch.int32
    assert meta.query_start_loc.tolist() == inputs.query_start_loc.tolist()
    assert meta.max_seq_len == inputs.max_seq_len and meta.max_query_len == inputs.max_query_len
    if inputs.group_slot_mappings is not None:
        assert meta.group_slot_mappings.tolist() == inputs.group_slot_mappings.tolist()


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("groups", [1, 2])
def test_a_repeated_decode_step_makes_no_tensor_on_the_cpu(groups):
    buffers = StepBuffers(torch.device("cpu"))
    tables = torch.zeros(groups, 3, 4, dtype=torch.int32)
    first = buffers.load(decode_inputs(3, 0, groups), tables)
    with Ops() as ops:
        ids, positions, meta = buffers.load(decode_inputs(3, 5, groups), tables)
    assert ops.seen == []  # numpy writes into the persistent buffers; the views were made at the first step
    check(decode_inputs(3, 5, groups), ids, positions, meta)
    assert ids is first[0] and meta.seq_lens is first[2].seq_lens  # the same tensors, rewritten
    assert meta.block_tables.data_ptr() == tables.data_ptr() and (meta.group_block_tables is None) == (groups == 1)


def test_a_longer_step_grows_the_buffers_and_a_shorter_one_reads_their_head():
    buffers = StepBuffers(torch.device("cpu"))
    tables = torch.zeros(1, 1, 4, dtype=torch.int32)
    n = FIRST_CAPACITY + 3
    long_step = StepInputs(
        input_ids=np.arange(n, dtype=np.int64), positions=np.arange(n, dtype=np.int64),
        slot_mapping=np.arange(n, dtype=np.int64) + 50, seq_lens=np.array([n], np.int32),
        query_start_loc=np.array([0, n], np.int32), logits_rows=[n - 1], max_query_len=n, max_seq_len=n,
        block_copies=[])
    three_streams = decode_inputs(2, 4)
    three_streams.positions = np.stack([three_streams.positions + k for k in range(3)])  # mRoPE's [3, T]
    for inputs in (decode_inputs(2, 1), long_step, three_streams, decode_inputs(2, 9)):
        check(inputs, *buffers.load(inputs, tables))


def host_ids(buffers: StepBuffers, k: int) -> np.ndarray:
    """The first two input ids in set k's host buffer."""
    return buffers.sets[k].buffers[0][1][:2].copy()


@pytest.mark.fake_cuda
def test_on_a_card_two_sets_alternate(fake_cuda):  # noqa: F811
    """Step N+1 writes the other set's host buffers: step N's may still feed a queued copy (async scheduling);
    step N+2 comes back to the first, after its fence."""
    buffers = StepBuffers(CUDA)
    tables = torch.zeros(1, 2, 4, dtype=torch.int32, device=CUDA)
    a = buffers.load(decode_inputs(2, 0), tables)
    written = host_ids(buffers, 0)
    b = buffers.load(decode_inputs(2, 1), tables)
    assert b[0].device == CUDA and b[2].seq_lens.device == CUDA and b[2].block_tables.device == CUDA
    assert a[0] is not b[0] and (host_ids(buffers, 0) == written).all()
    assert (host_ids(buffers, 1) == decode_inputs(2, 1).input_ids).all()
    c = buffers.load(decode_inputs(2, 2), tables)
    assert c[0] is a[0] and (host_ids(buffers, 0) == decode_inputs(2, 2).input_ids).all()


def test_a_graph_step_is_padded_on_the_host_and_copied_once_per_field():
    """Verify rows of 2 tokens, 2 real sequences padded to 3: padding ids and positions 0, slots -1 (no KV write),
    lengths of one row, offsets ending where the real tokens end; past the padded batch nothing is touched."""
    from types import SimpleNamespace

    from engine.worker.graphs.staging import GraphStaging
    static = SimpleNamespace(**{name: torch.full((8,), 9) for name in ("input_ids", "positions", "slot_mapping")},
                             seq_lens=torch.full((4,), 9, dtype=torch.int32),
                             query_start_loc=torch.full((5,), 9, dtype=torch.int32))
    staging = GraphStaging(static, 2, torch.device("cpu"))
    step = SimpleNamespace(input_ids=np.array([1, 2, 3, 4]), positions=np.array([5, 6, 7, 8]),
                           slot_mapping=np.array([10, 11, 12, 13]), seq_lens=np.array([6, 8], np.int32))
    staging.fill(SimpleNamespace(input_ids=np.zeros(4), positions=np.zeros(4), slot_mapping=np.zeros(4),
                                 seq_lens=np.zeros(2)), 2, 3)  # the (2, 3) views made once
    with Ops() as ops:
        staging.fill(step, 2, 3)
    assert ops.seen == ["aten.copy_.default"] * 5
    assert static.input_ids.tolist() == [1, 2, 3, 4, 0, 0, 9, 9]
    assert static.positions.tolist() == [5, 6, 7, 8, 0, 0, 9, 9]
    assert static.slot_mapping.tolist() == [10, 11, 12, 13, -1, -1, 9, 9]
    assert static.seq_lens.tolist() == [6, 8, 2, 9] and static.query_start_loc.tolist() == [0, 2, 4, 4, 9]
