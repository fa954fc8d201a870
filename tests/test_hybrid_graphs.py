"""CUDA graphs for hybrid models on CPU (issue 22): the decode graphs' padded static buffers, run eagerly,
update the linear-attention state pool in place through a static slot-index buffer, padding rows going to the
padding slot past the pool; the state of every real slot is what the unpadded eager step leaves, slots outside
the batch are untouched, and greedy ids equal HF's. The piecewise pieces (tape stand-in, Gated DeltaNet layers
eager between them on the step's real rows) give HF's ids over prompt, mixed and decode steps."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.attention import AttentionMetadata
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.piecewise_graphs import PiecewiseGraphs, TapeGraphBackend, token_buckets
from hf_reference import hf_greedy, make_prompts

pytestmark = pytest.mark.timeout(300)
PICKS, MAX_TOKENS = [1, 3, 4, 6], [10, 12, 6, 8]  # prompts of 3, 16, 17 and 120 tokens
BUDGET = 32  # piecewise: prompts arrive in 32-token chunks beside running decodes


@pytest.fixture(scope="module")
def hybrid_reference(tiny_model_dir):
    @functools.cache
    def get(arch):
        path = tiny_model_dir(arch)
        prompts = [make_prompts(400)[i] for i in PICKS]
        return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)
    return get


def greedy(llm: LLM, prompts) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS[:len(prompts)]]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def eager_forward(runner, inputs, tables) -> torch.Tensor:
    """The step as the runner runs it without graphs: exactly the real rows, the step's own metadata."""
    meta = AttentionMetadata(torch.from_numpy(inputs.slot_mapping), tables[0], torch.from_numpy(inputs.seq_lens),
                             torch.from_numpy(inputs.query_start_loc), inputs.max_query_len, inputs.max_seq_len)
    meta.state_indices = torch.from_numpy(inputs.state_indices)
    meta.has_initial_state = torch.from_numpy(inputs.has_initial_state)
    return runner.model(torch.from_numpy(inputs.input_ids), torch.from_numpy(inputs.positions), meta)


def test_decode_graphs_update_states_in_place_and_padding_touches_no_real_slot(hybrid_reference):
    path, prompts, expected = hybrid_reference("qwen3_5")
    llm = LLM(str(path), device="cpu", max_num_seqs=6)
    runner = llm.engine.runner
    runner.plan_decode_graphs(max_batch=6, capture=False)  # ladder 1, 2, 4, 6: 3 sequences pad to 4
    runner.allocate_state_cache(llm.engine.kv.state.pool.num_slots)  # the pool again, now with its padding slot
    graphs = runner.graphs
    pad = graphs.state_padding_slot
    assert pad == llm.engine.kv.state.pool.num_slots and runner.state_cache[0][0].shape[0] == pad + 1
    assert graphs.buffers.state_indices.dtype == torch.int32 and (graphs.buffers.state_indices == pad).all()
    padded, run = [], graphs.run

    def checked(inputs, tables):
        n = len(inputs.seq_lens)
        before = [(c.clone(), s.clone()) for c, s in runner.state_cache]
        want = eager_forward(runner, inputs, tables)
        eager_states = [(c.clone(), s.clone()) for c, s in runner.state_cache]
        for (c, s), (c0, s0) in zip(runner.state_cache, before):  # back to the step's start
            c.copy_(c0)
            s.copy_(s0)
        got = run(inputs, tables)
        batch = next(b for b in graphs.ladder if b >= n)
        assert (graphs.buffers.state_indices[:n].numpy() == inputs.state_indices).all()
        assert (graphs.buffers.state_indices[n:batch] == pad).all() and not graphs.buffers.has_initial_state[n:batch].any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        real = set(inputs.state_indices.tolist())
        untouched = [i for i in range(pad) if i not in real]
        for (c, s), (ce, se), (c0, s0) in zip(runner.state_cache, eager_states, before):
            rows = sorted(real)
            torch.testing.assert_close(c[rows], ce[rows], rtol=1e-5, atol=1e-5)  # real slots: the eager update
            torch.testing.assert_close(s[rows], se[rows], rtol=1e-5, atol=1e-5)
            assert torch.equal(c[untouched], c0[untouched]) and torch.equal(s[untouched], s0[untouched])
        if batch > n:
            padded.append(n)
            assert runner.state_cache[0][1][pad].abs().sum() > 0  # the padding rows did run, into their slot
        return got
    graphs.run = checked
    assert greedy(llm, prompts) == expected
    assert padded and 3 in padded  # four prompts finish at different steps: 3 sequences padded to 4


@pytest.mark.parametrize("arch", ["qwen3_next"])
def test_piecewise_replay_of_a_hybrid_matches_hf(hybrid_reference, arch):
    """Qwen3-Next: grouped projections, MoE with a torch expert loop (an eager point too), DeltaNet layers."""
    path, prompts, expected = hybrid_reference(arch)
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=BUDGET, max_num_seqs=4, enable_prefix_caching=False)
    runner = llm.engine.runner
    backend = TapeGraphBackend()
    graphs = PiecewiseGraphs(runner.model, BUDGET, runner.device, backend, strict=True,
                             num_kv_groups=len(runner.kv_layout.groups))
    graphs.capture()
    assert sorted(graphs.captured) == token_buckets(BUDGET)
    deltanets = [m for m in graphs.points if isinstance(m, GatedDeltaNet)]
    assert len(deltanets) == len(runner.model.state_layers()) == 2
    kinds, run = {}, graphs.run

    def counting(inputs, meta):
        q = np.diff(inputs.query_start_loc)
        kind = "decode" if q.max() == 1 else ("mixed" if (q == 1).any() else "prompt")
        kinds[kind] = kinds.get(kind, 0) + 1
        return run(inputs, meta)
    graphs.run = counting
    runner.piecewise = graphs
    assert greedy(llm, prompts) == expected
    print(f"{arch}: steps through the pieces by kind {kinds}, {backend.replays} pieces replayed")
    assert kinds.get("mixed", 0) > 0 and kinds.get("decode", 0) > 0
    assert graphs.replayed_tokens > 0
