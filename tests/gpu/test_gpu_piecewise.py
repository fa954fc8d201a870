"""Piecewise CUDA graphs on the card (issue 19 item 8): captured for every token bucket (on every rank under
tensor parallel: each bucket's capture is agreed by an all-reduce, so rank 0 holding a bucket means every rank
does), greedy ids identical to the eager engine over prompt, mixed and decode steps, and the share of decode
tokens that ran through a graph (whole-forward decode graphs or pieces) under a mixed workload printed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.worker.graphs.piecewise import token_buckets

pytestmark = pytest.mark.gpu
BUDGET = 128


def _workload(vocab: int):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, vocab, int(n)).tolist() for n in rng.integers(1, 300, 24)]
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True) for n in rng.integers(4, 40, 24)]
    return prompts, params


def _count_decode_tokens(runner, tally: dict) -> None:
    """Wrap the graph paths so every decode row (query of one token) is counted by the path that ran it."""
    def wrap(obj, key):
        run = obj.run

        def counted(inputs, *rest):
            tally[key] += int((np.diff(inputs.query_start_loc) == 1).sum())
            return run(inputs, *rest)
        obj.run = counted
    wrap(runner.graphs, "full")
    wrap(runner.piecewise, "piecewise")


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_oss"])
def test_piecewise_graphs_match_eager(tiny_model_dir, make_llm, arch):
    path = tiny_model_dir(arch)
    common = dict(dtype="float32", max_num_batched_tokens=BUDGET, max_num_seqs=8, enable_prefix_caching=False,
                  num_gpu_blocks_override=512)
    eager = make_llm(path, enforce_eager=True, **common)
    prompts, params = _workload(eager.engine.model_config.vocab_size)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.engine.runner.shutdown()

    llm = make_llm(path, **common)
    runner = llm.engine.runner
    assert runner.piecewise is not None and runner.piecewise.enabled, "piecewise capture failed (see the log)"
    assert sorted(runner.piecewise.captured) == token_buckets(BUDGET)
    assert runner.piecewise.pool_bytes > 0
    tally = {"full": 0, "piecewise": 0}
    _count_decode_tokens(runner, tally)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    total = sum(len(t) for t in got) - len(got)  # every token after the first comes from a decode row
    for i, (a, b) in enumerate(zip(got, want)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert a == b, f"request {i}: first divergence at token {first}"
    graphed = tally["full"] + tally["piecewise"]
    print(f"{arch}: decode tokens graphed {graphed} of {total} ({100 * graphed / max(total, 1):.0f}%): "
          f"{tally['full']} in decode graphs, {tally['piecewise']} in piecewise graphs (mixed steps); "
          f"pieces' pool {runner.piecewise.pool_bytes / 2**20:.0f} MiB, estimate was "
          f"{runner.graph_bytes() / 2**20:.0f} MiB with the decode graphs")
    assert tally["piecewise"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_piecewise_graphs_under_tensor_parallel(tiny_model_dir, make_llm):
    path = tiny_model_dir("llama")
    common = dict(dtype="float32", max_num_batched_tokens=BUDGET, max_num_seqs=8, enable_prefix_caching=False,
                  num_gpu_blocks_override=512, tensor_parallel_size=2)
    llm = make_llm(path, **common)
    rank0 = llm.engine.runner.runner
    assert rank0.piecewise is not None and sorted(rank0.piecewise.captured) == token_buckets(BUDGET)
    prompts, params = _workload(llm.engine.model_config.vocab_size)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.runner.shutdown()
    eager = make_llm(path, enforce_eager=True, **common)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want
