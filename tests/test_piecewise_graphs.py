"""Piecewise CUDA graphs (issue 19 item 8) on CPU: the tape stand-in records each piece's aten ops and replays
them on the same tensors (CUDA graphs' semantics: fixed addresses, values frozen at capture), with attention and
torch-loop MoE run eagerly between the pieces; greedy ids equal the eager engine's over prompt, mixed and decode
steps for a Llama, a sliding-window + soft-cap family (Gemma 2) and an MoE family with sinks and windows
(gpt-oss). What a piece cannot hold (a host sync, a metadata read outside attention) fails at capture."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.layers.attention import PagedAttention
from engine.config.model import ModelConfig
from engine.worker.graphs.piecewise import PiecewiseGraphs, eager_points, token_buckets
from graph_tape import PieceCaptureError, TapeGraphBackend
from engine.planning.activations import estimate_activation_bytes
from engine.planning.graphs import estimate_piecewise_graph_bytes, piecewise_bucket_count
from hf_reference import make_prompts

BUDGET = 32  # tokens per step: prompts of up to 120 tokens arrive in chunks beside running decodes
PICK = [1, 3, 5, 6]  # prompts of 3, 16, 40 and 120 tokens
MAX_NEW = [10, 6, 5, 4]


def test_token_buckets_cover_the_budget_with_bounded_padding():
    buckets = token_buckets(2048)
    assert buckets[:4] == [16, 32, 48, 64] and buckets[-1] == 2048 and buckets == sorted(set(buckets))
    assert all(b / a <= 1.25 for a, b in zip(buckets[4:], buckets[5:]))
    assert token_buckets(100)[-1] == 100 and token_buckets(5) == [5]
    for m in (1, 16, 17, 100, 2048, 8192):
        assert piecewise_bucket_count(m) == len(token_buckets(m))
    with pytest.raises(ValueError, match="max_tokens"):
        token_buckets(0)


def test_capture_memory_estimate_counts_the_budget_activations():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192)
    est = estimate_piecewise_graph_bytes(cfg, 2048, 2)
    assert est > estimate_activation_bytes(cfg, 2048, 2, 1, 0)
    assert estimate_piecewise_graph_bytes(cfg, 4096, 2) > est


def _step_kind(inputs) -> str:
    q = np.diff(inputs.query_start_loc)
    return "decode" if q.max() == 1 else ("mixed" if (q == 1).any() else "prompt")


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_oss"])
def test_piecewise_replay_matches_eager(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=BUDGET, max_num_seqs=2, enable_prefix_caching=False)
    prompts = [make_prompts(llm.engine.model_config.vocab_size)[i] for i in PICK]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_NEW]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    runner = llm.engine.runner
    backend = TapeGraphBackend()
    graphs = PiecewiseGraphs(runner.model, BUDGET, runner.device, backend, strict=True,
                             num_kv_groups=len(runner.kv_layout.groups))
    graphs.capture()
    assert sorted(graphs.captured) == token_buckets(BUDGET)
    layers = llm.engine.model_config.num_layers
    assert len(graphs.points) >= layers  # every attention layer (and gpt-oss's torch-loop MoE) runs eagerly
    assert all(len(b.pieces) == graphs.num_pieces for b in graphs.captured.values())
    kinds: dict[str, int] = {}
    run = graphs.run

    def counting(inputs, meta):
        kinds[_step_kind(inputs)] = kinds.get(_step_kind(inputs), 0) + 1
        return run(inputs, meta)
    graphs.run = counting
    runner.piecewise = graphs
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        runner.piecewise = None
    print(f"{arch}: steps through the pieces by kind {kinds}, {backend.replays} pieces replayed")
    assert got == eager
    assert kinds.get("mixed", 0) > 0 and kinds.get("decode", 0) > 0  # prompt rows of 1 token read as "mixed"
    assert backend.replays >= sum(kinds.values()) * graphs.num_pieces


class _Toy(nn.Module):
    """Linear, attention (no cache bound: it returns q), then `tail` on the result."""

    def __init__(self, tail) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.attn = PagedAttention(2, 2, 4, None)
        self.tail = tail

    def forward(self, input_ids, positions, meta):
        x = self.proj(input_ids.float()[:, None].expand(-1, 8))
        out = self.attn(x.view(-1, 2, 4), x.view(-1, 2, 4), x.view(-1, 2, 4), meta).view(-1, 8)
        return self.tail(out, meta)


@pytest.mark.parametrize("tail, found", [
    (lambda out, meta: out * float(out.sum().item()), "host sync"),
    (lambda out, meta: out * meta.seq_lens.float().sum(), "attention metadata"),
])
def test_what_a_piece_cannot_hold_fails_at_capture(tail, found, caplog):
    model = _Toy(tail)
    assert eager_points(model) == [model.attn]
    with torch.inference_mode(), pytest.raises(PieceCaptureError, match=found):
        PiecewiseGraphs(model, 32, torch.device("cpu"), TapeGraphBackend(), strict=True).capture()
    graphs = PiecewiseGraphs(model, 32, torch.device("cpu"), TapeGraphBackend())  # production: log, stay eager
    with caplog.at_level(logging.WARNING, logger="pagedesk.engine"):
        graphs.capture()
    assert not graphs.enabled and not graphs.captured
    assert "piecewise CUDA graph capture failed" in caplog.text and "run eagerly" in caplog.text
    assert "forward" not in model.attn.__dict__  # the capture hook is gone from the instance


def test_toy_replay_recomputes_from_the_static_buffers():
    """Values are not frozen: replaying a bucket with new inputs gives the eager forward's result on them."""
    model = _Toy(lambda out, meta: torch.relu(out) + 1)
    graphs = PiecewiseGraphs(model, 32, torch.device("cpu"), TapeGraphBackend(), strict=True)
    graphs.capture()

    class Inputs:
        input_ids = np.arange(3, 23, dtype=np.int64)
        positions = np.arange(20, dtype=np.int64)
        slot_mapping = np.full(20, -1, dtype=np.int64)
        group_slot_mappings = None
    with torch.inference_mode():
        meta = graphs._capture_meta(20)
        got = graphs.run(Inputs, meta).clone()
        want = model(torch.from_numpy(Inputs.input_ids), torch.from_numpy(Inputs.positions), meta)
    assert got.shape == (20, 8) and torch.equal(got, want)


def test_cuda_backend_keeps_tensors_without_owning_them():
    """keep() aliases the memory (later writes show through) and holds no reference to the storage's owner."""
    from engine.worker.graphs.piecewise import CudaGraphBackend
    base = torch.arange(12.0)
    view = base[2:8].view(2, 3)
    kept = CudaGraphBackend.keep(view)
    base.add_(100)
    assert torch.equal(kept, view) and kept.data_ptr() == view.data_ptr() and kept.stride() == view.stride()
    assert kept.untyped_storage()._cdata != base.untyped_storage()._cdata  # its own, non-owning storage
