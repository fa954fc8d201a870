"""Decode CUDA graphs: the ladder, and the padded static-buffer path (run eagerly on CPU) leaves greedy
output identical to HF; only the capture call itself needs a GPU."""
from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.worker.graphs.decode import batch_size_ladder
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


def test_padded_verify_path_matches_hf(reference):
    """Speculative verify steps (1 + k tokens per row) through their own padded static buffers, run eagerly on
    CPU as the decode graphs' are: greedy output stays HF's, and steps with full rows did pick the graphs."""
    path, prompts, expected = reference("qwen3")
    prompts, expected, k = prompts[:4], expected[:4], 2  # batches 4, 3 (padded to 4), 2, 1 as requests finish
    llm = LLM(str(path), device="cpu", speculative_config={"model": str(path), "num_speculative_tokens": k})
    runner = llm.engine.runner
    runner.plan_decode_graphs(max_batch=4, capture=False, verify_query_len=1 + k)
    graphs = runner.verify_graphs
    buf = graphs.buffers  # token buffers hold max batch × (1 + k) rows; query offsets are multiples of 1 + k
    assert (graphs.query_len, graphs.ladder, buf.input_ids.shape[0]) == (3, [1, 2, 4], 12)
    assert buf.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    used = []
    run = graphs.run
    graphs.run = lambda inputs, tables: used.append(len(inputs.seq_lens)) or run(inputs, tables)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS[:4]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert used and max(used) <= 4 and any(n not in graphs.ladder for n in used)  # padded verify batches
    stats = llm.engine.spec.stats
    assert stats.num_accepted_tokens >= 0.99 * stats.num_draft_tokens > 0  # the draft is the target


def test_a_verify_graph_takes_only_steps_whose_every_row_is_full():
    from types import SimpleNamespace

    from engine.worker.graphs.decode import DecodeGraphs, context_buckets

    graphs = DecodeGraphs(None, 4, 64, 16, torch.device("cpu"), capture=False, query_len=3)
    step = lambda tokens, seqs, q: SimpleNamespace(input_ids=[0] * tokens, seq_lens=[5] * seqs,  # noqa: E731
                                                   max_query_len=q, width=2)
    assert graphs.can_run(step(6, 2, 3))
    assert not graphs.can_run(step(5, 2, 3))  # one row has fewer drafts: eager (or piecewise)
    assert not graphs.can_run(step(2, 2, 1)) and not graphs.can_run(step(15, 5, 3))  # a decode; too many rows
    # The kernel key sees the verify step's token count: tiles differ from a decode batch's.
    keys = []
    context_buckets(4, 1024, 16, lambda *shape: keys.append(shape) or shape[1], query_len=3)
    assert keys and all(len(k) == 3 and k[2] == 3 for k in keys)


def test_verify_graphs_capture_every_batch_with_its_token_rows(llama_dir, monkeypatch):
    """The capture loop on CPU with a stand-in graph (the forward runs once inside the capture, as on a card):
    one graph per ladder batch, each output holding batch × (1 + k) token rows, replayed by a full verify step."""
    import contextlib
    from types import SimpleNamespace

    import numpy as np

    from engine.worker.graphs import decode as cuda_graphs
    from engine.worker.graphs.decode import DecodeGraphs

    class StandInGraph:
        def replay(self):
            pass

    runner = LLM(str(llama_dir), device="cpu", num_gpu_blocks_override=8).engine.runner
    for name, fake in {"memory_allocated": lambda device=None: 0, "memory_reserved": lambda device=None: 0,
                       "synchronize": lambda device=None: None, "empty_cache": lambda: None,
                       "graph_pool_handle": lambda: None, "CUDAGraph": StandInGraph,
                       "graph": lambda graph, pool=None: contextlib.nullcontext()}.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(cuda_graphs, "all_reduce", lambda t: t)
    graphs = DecodeGraphs(runner.model, 4, 64, 16, runner.device, capture=False, query_len=3)
    graphs.capture_graphs = True
    graphs.capture()
    assert sorted(graphs.graphs) == [(1, 64), (2, 64), (4, 64)]
    assert {key: out.shape[0] for key, out in graphs.outputs.items()} == {(1, 64): 3, (2, 64): 6, (4, 64): 12}
    # Two sequences of 5 + 3 tokens: padded to the batch-2 graph, whose output rows are the 6 tokens.
    step = SimpleNamespace(input_ids=np.arange(6), positions=np.tile(np.arange(5, 8), 2),
                           slot_mapping=np.arange(6) + 16, seq_lens=np.array([8, 8], dtype=np.int32),
                           max_query_len=3, max_seq_len=8, width=1, group_slot_mappings=None)
    assert graphs.can_run(step)
    hidden = graphs.run(step, torch.tensor([[[1], [2]]], dtype=torch.int32))
    assert hidden.data_ptr() == graphs.outputs[2, 64].data_ptr() and hidden.shape[0] == 6
