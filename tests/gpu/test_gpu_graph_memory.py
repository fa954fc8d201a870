"""What a captured decode graph costs on the card (issue 32 item 4): memory and capture time per graph, measured,
where engine/planning/graphs.GRAPH_OVERHEAD_BYTES (2 MiB per graph) was an estimate.

Random Llamas with tiny widths and 2, 16 and 32 layers (an 8B model's 32 layers launch as many kernels per
forward as it does, with activations too small to matter) capture the decode-graph ladder of 64 sequences over a
2,048-token context. Per graph: the card's free memory lost (driver-side graph objects included, what the KV
sizing must leave room for), the graphs' private pool (torch's reserved memory), and the capture time. Run:

    python -m pytest -q -s tests/gpu/test_gpu_graph_memory.py

and paste the printed table into BENCHMARKS.md ("CUDA graphs: memory and capture time per graph").
"""
from __future__ import annotations

import time

import pytest
import torch

from engine.planning.graphs import GRAPH_OVERHEAD_BYTES

pytestmark = pytest.mark.gpu
ROWS: list[str] = []


@pytest.mark.parametrize("layers", [2, 16, 32])
def test_memory_and_capture_time_per_decode_graph(tiny_model_dir, make_llm, layers):
    from engine.worker.graphs.decode import DecodeGraphs, triton_split_key
    path = tiny_model_dir("llama", num_hidden_layers=layers)
    llm = make_llm(path, dtype="bfloat16", enforce_eager=True, num_gpu_blocks_override=256, max_num_seqs=64,
                   max_model_len=2048)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, 64, 2048, runner.block_size, runner.device,
                          split_key=triton_split_key(runner.model, runner.device))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before, reserved_before = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    start = time.perf_counter()
    graphs.capture()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    torch.cuda.empty_cache()
    n = len(graphs.graphs)
    assert n and graphs.capture_graphs, "capture failed (see the log)"
    lost = free_before - torch.cuda.mem_get_info()[0]
    pool = torch.cuda.memory_reserved() - reserved_before
    row = (f"| {layers} | {n} | {lost / n / 2**20:.2f} | {pool / n / 2**20:.2f} | {(lost - pool) / n / 2**10:.0f} | "
           f"{1000 * graphs.capture_seconds / n:.1f} | {1000 * seconds / n:.1f} |")
    ROWS.append(row)
    print("\n| layers | graphs | MiB lost per graph | pool MiB per graph | KiB outside the pool per graph | "
          "capture ms per graph | with warm-up ms per graph |\n|---|---|---|---|---|---|---|\n" + "\n".join(ROWS))
    if layers == 32:  # an 8B model's kernel count: the estimate the KV sizing leaves room for must hold
        assert lost / n <= GRAPH_OVERHEAD_BYTES, f"{lost / n / 2**20:.2f} MiB per graph, estimated 2 MiB"
