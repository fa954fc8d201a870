"""The Gated DeltaNet chunk table made once per step on the host (issue 32 item 5): the Triton chunked kernels
used to read query_start_loc back from the card in every DeltaNet layer of a prefill step (36 host syncs a step
for Qwen3-Next); the step's metadata now carries the table (kernels/gated_delta_chunks.py), built from the host's
own offsets, and every layer reuses it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config.model import ModelConfig
from engine.worker.model_runner import ModelRunner
from engine.worker.step_inputs import StepInputs
from kernels.gated_delta_chunks import CHUNK, chunk_arrays
from test_fake_cuda import CUDA, Recorder, _as_if_on_cpu, fake_cuda  # noqa: F401 (fixture)


def test_the_table_cuts_every_long_row_into_chunks():
    starts = [0, 1, 40, 41, 57, 57, 90]  # rows of 1, 39, 1, 16, 0 and 33 tokens
    chunk_seq, chunk_first, long_seqs = chunk_arrays(np.array(starts))
    assert long_seqs.tolist() == [1, 3, 5]
    assert chunk_seq.tolist() == [1, 1, 1, 3, 5, 5, 5]
    assert chunk_first.tolist() == [1, 1 + CHUNK, 1 + 2 * CHUNK, 41, 57, 57 + CHUNK, 57 + 2 * CHUNK]
    assert chunk_seq.dtype == chunk_first.dtype == long_seqs.dtype == np.int32
    assert [len(a) for a in chunk_arrays([0, 1, 2])] == [0, 0, 0]  # decodes only: nothing chunked


@pytest.fixture(scope="module")
def hybrid_weights(tiny_model_dir):
    from engine.worker.loader import iterate_weights
    path = tiny_model_dir("qwen3_next")
    return path, list(iterate_weights(path, device="cpu"))


@pytest.mark.fake_cuda
def test_a_prefill_step_reads_nothing_back_from_the_card(hybrid_weights, fake_cuda, monkeypatch):  # noqa: F811
    """A mixed step (a 40-token prompt chunk beside two decodes) on fake CUDA: every DeltaNet layer launches the
    chunked kernels with the step's one table, and no layer copies anything to the host."""
    import engine.worker.model_runner
    import kernels.triton_attention as ta
    import kernels.triton_causal_conv1d as tc
    import kernels.triton_gated_delta as tg
    import kernels.triton_moe as tm
    import kernels.triton_write_kv as tw
    path, weights = hybrid_weights
    monkeypatch.setattr(engine.worker.model_runner, "iterate_weights", lambda p, device: iter(weights))
    monkeypatch.setattr(ta, "_device_facts", lambda device: (8, 8))
    monkeypatch.setattr(tm, "device_name", lambda device: "fake")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * 2**30, 24 * 2**30))
    monkeypatch.setattr(torch.Tensor, "contiguous", _as_if_on_cpu(torch.Tensor.contiguous))
    for module, name in ((ta, "paged_attention_kernel"), (ta, "reduce_splits_kernel"), (tw, "write_kv_kernel"),
                         (tm, "fused_moe_kernel"), (tg, "fused_recurrent_kernel"), (tg, "chunk_prepare_kernel"),
                         (tg, "chunk_state_kernel"), (tc, "causal_conv1d_kernel"), (tc, "conv_state_update_kernel")):
        monkeypatch.setattr(module, name, Recorder(name, fake_cuda))
    runner = ModelRunner(ModelConfig.from_folder(path), path, CUDA, torch.float16, 16, "triton")
    runner.allocate_kv_cache(8, torch.float16, num_state_slots=4)
    inputs = StepInputs(
        input_ids=np.arange(42) % 50, positions=np.concatenate([[5, 9], np.arange(40)]),
        slot_mapping=np.concatenate([[5, 25], 32 + np.arange(40)]),
        block_tables=np.array([[0, 0, 0], [1, 0, 0], [2, 3, 4]], dtype=np.int32),
        seq_lens=np.array([6, 10, 40], np.int32), query_start_loc=np.array([0, 1, 2, 42], dtype=np.int32),
        logits_rows=[0, 1, 41], max_query_len=40, max_seq_len=40, block_copies=[],
        state_indices=np.array([3, 0, 1], np.int32), has_initial_state=np.array([True, True, False]))
    assert runner.run(inputs) is None
    layers = len(runner.model.state_layers())
    assert fake_cuda.launches.count("chunk_state_kernel") == layers == 2
    assert fake_cuda.host_copies == 0  # was one query_start_loc.tolist() per DeltaNet layer
