"""CUDA graphs for decode steps: the whole forward captured once per batch size on a ladder, replayed with padding.

Decode batches (one new token per sequence) are copied into static input buffers sized for the
smallest captured batch that holds them; padding rows get slot -1 (their K/V write is skipped) and a
one-token context in block 0 (their output is discarded), so they never touch a real sequence's cache.
On CPU, or to test the padding logic without a GPU, `capture=False` runs the same padded buffers
eagerly: the CPU tests exercise every line except the capture call itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from engine.layers.attention import AttentionMetadata

logger = logging.getLogger("pagedesk.engine")


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (vLLM's spacing): padding wastes at most 15 rows."""
    ladder = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 16, 16))
    return sorted({min(b, max_batch) for b in ladder})


@dataclass
class StaticBuffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def meta(self, batch: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:batch], self.block_tables[:batch], self.seq_lens[:batch],
                                 self.query_start_loc[:batch + 1], 1, max_seq_len)


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_model_len: int, block_size: int, device: torch.device,
                 capture: bool = True) -> None:
        self.model = model
        self.ladder = batch_size_ladder(max_batch)
        self.max_batch = self.ladder[-1]
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.capture_graphs = capture and device.type == "cuda"
        b = self.max_batch
        with torch.device(device):
            self.buffers = StaticBuffers(
                input_ids=torch.zeros(b, dtype=torch.long), positions=torch.zeros(b, dtype=torch.long),
                slot_mapping=torch.full((b,), -1, dtype=torch.long),
                block_tables=torch.zeros(b, self.max_blocks, dtype=torch.int32),
                seq_lens=torch.ones(b, dtype=torch.int32), query_start_loc=torch.arange(b + 1, dtype=torch.int32))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool_bytes = 0

    def can_run(self, inputs) -> bool:
        num_seqs = len(inputs.seq_lens)
        return (inputs.max_query_len == 1 and len(inputs.input_ids) == num_seqs and num_seqs <= self.max_batch
                and inputs.block_tables.shape[1] <= self.max_blocks)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every ladder size, largest first so the smaller graphs reuse its memory pool."""
        if not self.capture_graphs:
            return
        before = torch.cuda.memory_allocated(self.device)
        pool = torch.cuda.graph_pool_handle()
        for batch in tqdm(list(reversed(self.ladder)), desc="Capturing CUDA graphs", unit="graph"):
            meta = self.buffers.meta(batch, self.max_model_len)
            self.model(self.buffers.input_ids[:batch], self.buffers.positions[:batch], meta)  # warm-up
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self.model(self.buffers.input_ids[:batch], self.buffers.positions[:batch], meta)
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_allocated(self.device) - before
        logger.info("captured %d CUDA graphs (batch sizes %s), %.0f MiB", len(self.graphs), self.ladder,
                    self.pool_bytes / 2**20)

    def run(self, inputs) -> torch.Tensor:
        """Hidden states ``[num_seqs, hidden]`` of a decode batch through the padded static buffers."""
        n = len(inputs.seq_lens)
        batch = next(b for b in self.ladder if b >= n)
        self._fill(inputs, n, batch)
        if batch in self.graphs:
            self.graphs[batch].replay()
            return self.outputs[batch][:n]
        meta = self.buffers.meta(batch, self.max_model_len)
        return self.model(self.buffers.input_ids[:batch], self.buffers.positions[:batch], meta)[:n]

    def _fill(self, inputs, n: int, batch: int) -> None:
        buf = self.buffers
        width = inputs.block_tables.shape[1]
        buf.input_ids[:n].copy_(torch.as_tensor(inputs.input_ids), non_blocking=True)
        buf.positions[:n].copy_(torch.as_tensor(inputs.positions), non_blocking=True)
        buf.slot_mapping[:n].copy_(torch.as_tensor(inputs.slot_mapping), non_blocking=True)
        buf.seq_lens[:n].copy_(torch.as_tensor(inputs.seq_lens), non_blocking=True)
        buf.block_tables[:n, :width].copy_(torch.as_tensor(inputs.block_tables), non_blocking=True)
        buf.block_tables[:n, width:] = 0
        if batch > n:  # padding rows: no write, one token of context in block 0, output discarded
            buf.input_ids[n:batch] = 0
            buf.positions[n:batch] = 0
            buf.slot_mapping[n:batch] = -1
            buf.seq_lens[n:batch] = 1
            buf.block_tables[n:batch] = 0
