"""Decode CUDA graphs: the ladder, and the padded static-buffer path (run eagerly on CPU) leaves greedy
output identical to HF; only the capture call itself needs a GPU."""
from __future__ import annotations

from engine import LLM, SamplingParams
from engine.cuda_graphs import batch_size_ladder
from hf_reference import MAX_TOKENS


def test_batch_size_ladder():
    assert batch_size_ladder(256)[:6] == [1, 2, 4, 8, 16, 32] and batch_size_ladder(256)[-1] == 256
    assert batch_size_ladder(5) == [1, 2, 4, 5]
    assert batch_size_ladder(40) == [1, 2, 4, 8, 16, 32, 40]


def test_padded_decode_path_matches_hf(reference):
    path, prompts, expected = reference("qwen3")
    llm = LLM(str(path), device="cpu")
    runner = llm.engine.runner
    runner.plan_decode_graphs(max_batch=6, capture=False)  # 8 prompts: batches of 7-8 fall back to eager
    used = []
    run = runner.graphs.run
    runner.graphs.run = lambda inputs, tables: used.append(len(inputs.seq_lens)) or run(inputs, tables)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert used and max(used) <= 6 and any(n not in runner.graphs.ladder for n in used)  # padding happened
    assert runner.graph_bytes() == 0  # nothing captured on CPU
