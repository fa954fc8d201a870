"""The CUDA-graph coverage analysis (engine/bench/graph_share.py): the real scheduler on the bench workload,
with every step counted once and every token where it belongs."""
from __future__ import annotations

from engine.bench.graph_share import simulate, table
from engine.bench.workload import sharegpt_like


def test_counts_add_up_to_the_workload():
    requests = sharegpt_like(40, 1000, 512, seed=3)
    for every in (0, 3):
        c = simulate(requests, every, max_num_seqs=16, max_num_batched_tokens=256, num_blocks=4096)
        # No preemption in a pool this large: each prompt is computed once, and every output token but the
        # first (sampled by the prompt's last chunk) comes from a decode; a prompt's last chunk of one token
        # is a one-token query like a decode (graph-eligible), so it counts there.
        prompts = sum(len(r.prompt_token_ids) for r in requests)
        assert c.prefill_tokens + c.decode_tokens_pure + c.decode_tokens_mixed == prompts + sum(
            r.output_len - 1 for r in requests)
        assert prompts - len(requests) <= c.prefill_tokens <= prompts
        assert c.mixed_steps > 0 and c.decode_steps > 0 and c.steps == c.decode_steps + c.mixed_steps + c.prefill_steps


def test_table_prints_a_row_per_arrival_pattern():
    lines = table(12, 0).splitlines()
    assert len(lines) == 2 + 4 and lines[2].startswith("| all at once |")
