"""Speculative verify steps on the card (issue 23): the verify CUDA graphs (batch, 1 + k) are captured beside
the decode graphs, verify steps with full rows replay them, and greedy ids match the same engine without
speculation; the replays' share of verify steps is printed."""
from __future__ import annotations

import pytest

from gpu_reference import greedy_tokens
from hf_reference import MAX_TOKENS, make_prompts

pytestmark = pytest.mark.gpu
K = 3


def test_verify_steps_replay_their_graphs_and_match_no_speculation(tiny_model_dir, make_llm):
    path = tiny_model_dir("llama")
    prompts = make_prompts(400)
    flags = dict(dtype="float32", num_gpu_blocks_override=256)
    expected = greedy_tokens(make_llm(path, **flags), prompts, MAX_TOKENS)
    llm = make_llm(path, speculative_config={"model": str(path), "num_speculative_tokens": K}, **flags)
    graphs = llm.engine.runner.verify_graphs
    assert graphs is not None and graphs.graphs, "no verify graph was captured"
    assert {b for b, _ in graphs.graphs} == set(graphs.ladder) and graphs.query_len == 1 + K
    replays, steps = [], []
    run = graphs.run

    def counted(inputs, tables):
        steps.append(len(inputs.seq_lens))
        return run(inputs, tables)
    graphs.run = counted
    for graph in graphs.graphs.values():
        replay = graph.replay
        graph.replay = lambda replay=replay: replays.append(1) or replay()
    got = greedy_tokens(llm, prompts, MAX_TOKENS)
    same = sum(a == b for x, y in zip(got, expected) for a, b in zip(x, y)) / sum(map(len, expected))
    assert same >= 0.99, f"{same:.2%} of tokens as without speculation"
    assert steps and len(replays) == len(steps)  # every verify step that took the graphs replayed one
    stats = llm.engine.spec.stats
    print(f"verify steps through graphs: {len(steps)}; acceptance {stats.num_accepted_tokens}/"
          f"{stats.num_draft_tokens}")
