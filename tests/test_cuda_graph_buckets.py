"""Decode graphs per context-length bucket (the attention kernel's split count follows the context, not
max_model_len), and a failed capture that leaves decode eager instead of stopping the engine."""
from __future__ import annotations

import logging

import torch

from engine import LLM, SamplingParams
from engine.worker.graphs.decode import DecodeGraphs, context_buckets
from engine.planning.graphs import context_length_ladder
from hf_reference import MAX_TOKENS
from kernels.triton_attention import choose_tiles


def test_context_buckets_follow_the_kernels_split_choice():
    assert context_length_ladder(8192) == [512, 1024, 2048, 4096, 8192]
    assert context_length_ladder(600) == [512, 600]
    assert context_buckets(4, 8192, 16, None) == [8192]  # torch attention: the width changes nothing
    # The Triton tile choice on an 8-SM device: one decode sequence (2 programs) splits by length, 2 splits of
    # >= 256 keys at 512, 4 at 1024, then 8 (capped by 2 × SMs / programs) from 2048 on, so 2048 … 8192 share
    # the 8192 graph; 64 sequences fill the device and never split.
    key = lambda batch, width: choose_tiles(batch, batch, 2, 4, 64, width, torch.device("cpu"))  # noqa: E731
    assert context_buckets(1, 8192, 16, key) == [512, 1024, 8192]
    assert context_buckets(64, 8192, 16, key) == [8192]


def test_bucketed_padded_decode_matches_hf(reference):
    path, prompts, expected = reference("qwen3")
    llm = LLM(str(path), device="cpu")
    runner = llm.engine.runner
    # Every ladder length its own bucket (key = width): steps must replay through narrow block tables.
    runner.graphs = DecodeGraphs(runner.model, 8, 512, 16, runner.device, capture=False,
                                 split_key=lambda batch, width: width)
    assert runner.graphs.contexts[1] == [512]  # max_model_len 512: the ladder is just [512]
    runner.graphs.contexts = {b: [32, 64, 128, 512] for b in runner.graphs.ladder}
    widths = []
    meta = runner.graphs.buffers.meta
    runner.graphs.buffers.meta = lambda b, c, bs: widths.append(c) or meta(b, c, bs)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert len(set(widths)) >= 3 and max(widths) == 512  # narrow graphs while contexts are short


def test_failed_capture_falls_back_to_eager(llama_dir, monkeypatch, caplog):
    runner = LLM(str(llama_dir), device="cpu").engine.runner
    graphs = DecodeGraphs(runner.model, 4, 64, 16, runner.device, capture=False)
    graphs.capture_graphs = True  # as on CUDA; the capture itself then fails like a driver or NCCL would
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def fail(keys):
        graphs.graphs[keys[0]] = object()  # a half-finished capture must not survive
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(graphs, "_capture_all", fail)
    with caplog.at_level(logging.WARNING, logger="pagedesk.engine"):
        graphs.capture()
    assert not graphs.graphs and not graphs.capture_graphs
    assert caplog.messages == ["CUDA graph capture failed (RuntimeError: operation not permitted when stream is "
                               "capturing); decode steps run eagerly (slower, same results)"]



class RecordingGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: the capture context runs the forward once."""

    def replay(self):
        pass


def test_every_rank_falls_back_when_another_rank_cannot_capture(llama_dir, monkeypatch, caplog):
    import contextlib

    from engine.worker.graphs import decode as cuda_graphs
    runner = LLM(str(llama_dir), device="cpu").engine.runner
    graphs = DecodeGraphs(runner.model, 4, 64, 16, runner.device, capture=False)
    graphs.capture_graphs = True
    for name, fake in {"memory_allocated": lambda device=None: 0, "synchronize": lambda device=None: None,
                       "graph_pool_handle": lambda: None, "CUDAGraph": RecordingGraph,
                       "graph": lambda graph, pool=None: contextlib.nullcontext()}.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    flags = []
    # The all-reduce of "failed" flags: this rank captured its graphs; the other rank fails on its third one.
    monkeypatch.setattr(cuda_graphs, "all_reduce", lambda t: flags.append(int(t)) or t + (len(flags) == 3))
    with caplog.at_level(logging.WARNING, logger="pagedesk.engine"):
        graphs.capture()
    assert flags == [0, 0, 0] and not graphs.graphs and not graphs.capture_graphs
    assert "another tensor-parallel rank could not capture this graph" in caplog.text
    graphs.capture_graphs = True
    monkeypatch.setattr(cuda_graphs, "all_reduce", lambda t: t)  # one rank, all well: every graph kept
    graphs.capture()
    assert sorted(graphs.graphs) == [(1, 64), (2, 64), (4, 64)]
