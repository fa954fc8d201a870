"""CUDA graphs for hybrid models on the card (issue 22): the tiny Qwen3.5 / Qwen3-Next with decode graphs (the
Gated DeltaNet state updated in place through the static slot-index buffer, padding rows on the padding slot) and
piecewise graphs (DeltaNet layers eager between the pieces) give the eager engine's greedy ids in float32 over
prompt, mixed and decode steps, with prefix-cache hits restoring state snapshots. Ready for the first card:
it has not run on one yet."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.worker.graphs.piecewise import token_buckets

pytestmark = pytest.mark.gpu
BUDGET = 128


def _workload(vocab: int):
    rng = np.random.default_rng(1)
    system = rng.integers(5, vocab, 48).tolist()  # a shared prefix: the second pass hits the prefix cache
    prompts = [system + rng.integers(5, vocab, int(n)).tolist() for n in rng.integers(1, 200, 12)]
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True) for n in rng.integers(4, 30, 12)]
    return prompts, params


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_hybrid_graphs_match_eager(tiny_model_dir, make_llm, arch):
    path = tiny_model_dir(arch)
    common = dict(dtype="float32", max_num_batched_tokens=BUDGET, max_num_seqs=8, num_gpu_blocks_override=512)
    eager = make_llm(path, enforce_eager=True, **common)
    prompts, params = _workload(eager.engine.model_config.vocab_size)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.engine.runner.shutdown()

    llm = make_llm(path, **common)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.graphs, "decode graph capture failed (see the log)"
    assert runner.piecewise is not None and sorted(runner.piecewise.captured) == token_buckets(BUDGET)
    pad = runner.graphs.state_padding_slot
    assert pad == runner.state_cache[0][1].shape[0] - 1
    used = {"full": 0, "piecewise": 0}
    for key, obj in (("full", runner.graphs), ("piecewise", runner.piecewise)):
        def counted(inputs, *rest, _run=obj.run, _key=key):
            used[_key] += 1
            return _run(inputs, *rest)
        obj.run = counted
    for attempt in range(2):  # the second pass restores state snapshots on prefix hits
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for i, (a, b) in enumerate(zip(got, want)):
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            assert a == b, f"pass {attempt}, request {i}: first divergence at token {first}"
    torch.cuda.synchronize()
    print(f"{arch}: {len(runner.graphs.graphs)} decode graphs, {used['full']} decode steps replayed, "
          f"{used['piecewise']} steps through the pieces, prefix hits {llm.engine.kv.prefix_hits}")
    assert used["full"] > 0 and used["piecewise"] > 0 and llm.engine.kv.prefix_hits > 0
    assert runner.state_cache[0][1][pad].abs().sum() > 0  # padding rows ran, into the padding slot only
