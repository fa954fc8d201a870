"""CUDA graphs for decode steps: the whole forward captured per (batch size, context length), replayed with padding.

Decode batches (one new token per sequence) are copied into static input buffers sized for the
smallest captured batch that holds them; padding rows hold no tokens (their query range is empty, after the
real tokens), and their token rows get slot -1 and are discarded, so no kernel reads or writes anything for
them: not a real sequence's cache, and not a hybrid model's padding state slot, which they would otherwise all
update at once.
The attention kernel picks its KV split count from the block-table width, which a graph freezes; so
each batch size is captured at the context lengths of a ladder where that choice changes
(`split_key`; lengths with the same kernel configuration share one graph), and a step replays the
narrowest graph that covers its longest sequence. A capture that fails (a driver, NCCL or kernel that
cannot be captured) logs one line and leaves decode eager. KV cache groups past the first (sliding-window
models) get their own static block tables and slots, filled the same way. A hybrid model's linear-attention layers
read and write their state pool in place through a static slot-index buffer (`state_indices`, with
`has_initial_state`): real rows carry their sequences' slots, padding rows the runner's padding slot, one slot past
the pool that no sequence ever holds (an index in range; with no tokens they leave it alone), so the captured state
update needs no gather and padding never touches a real state. On CPU, or to test the padding logic without a GPU,
`capture=False` runs the same padded buffers eagerly: the CPU tests exercise every line except the capture call
itself.

Speculative verify steps (each sequence feeds its last token and k drafts: 1 + k query tokens) get their own set,
`query_len=1 + k`, keyed the same way by (batch, context length): every real row holds exactly `query_len` tokens
(the static query offsets are multiples of it), padding rows none. Only steps whose every row has `query_len` tokens
replay them; a step with shorter rows (a sequence with fewer drafts) runs like any other mixed step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Hashable

import torch
from tqdm.auto import tqdm

from engine.distributed.parallel_state import all_reduce
from engine.layers.attention import AttentionMetadata
from engine.planning.graphs import batch_size_ladder, context_length_ladder
from engine.worker.graphs.backend import CudaGraphBackend
from engine.worker.graphs.staging import GraphStaging

__all__ = ["DecodeGraphs", "batch_size_ladder", "context_buckets", "triton_split_key"]
logger = logging.getLogger("pagedesk.engine")
# (batch size, block-table width in tokens[, query tokens per row, when more than 1]) -> kernel configuration
SplitKey = Callable[..., Hashable]


def context_buckets(batch: int, max_model_len: int, block_size: int, split_key: SplitKey | None,
                    query_len: int = 1) -> list[int]:
    """Context lengths to capture `batch` at: the longest length of each run of ladder lengths that share
    one kernel configuration (without a key, attention does not depend on the width: max_model_len only)."""
    if split_key is None:
        return [max_model_len]
    buckets: list[int] = []
    last = None
    for length in reversed(context_length_ladder(max_model_len)):
        width = -(-length // block_size) * block_size
        key = split_key(batch, width) if query_len == 1 else split_key(batch, width, query_len)
        if key != last:
            buckets.append(length)
            last = key
    return sorted(buckets)


def triton_split_key(model, device: torch.device, facts: list[tuple[int, int]] | None = None) -> SplitKey:
    """The Triton kernel's tile and split choice for a decode (or verify: `query_len` tokens per row) batch at
    a given block-table width. `facts`: under tensor parallel every rank's (SM count, compute capability major)
    (engine/worker/graphs/dispatch.rank_facts): the key is the choice of each of those cards, the same on every
    rank, so every rank captures the same graphs, and only where some card's launch really changes."""
    from kernels.triton_attention import choose_tiles
    attn = model.attention_layers()[0]
    group = attn.num_heads // attn.num_kv_heads
    cards = sorted(set(facts)) if facts else [None]
    return lambda batch, width, query_len=1: tuple(
        choose_tiles(batch * query_len, batch, attn.num_kv_heads, group, attn.head_dim, width, device, facts=card)
        for card in cards)


@dataclass
class StaticBuffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    group_slot_mappings: torch.Tensor | None = None  # [num_groups - 1, max batch]
    group_block_tables: torch.Tensor | None = None  # [num_groups - 1, max batch, max blocks]
    state_indices: torch.Tensor | None = None  # [max batch] int32: hybrid models' state slot per row
    has_initial_state: torch.Tensor | None = None  # [max batch] bool
    query_len: int = 1  # tokens per row: token-indexed buffers hold max batch × query_len

    def meta(self, batch: int, context_len: int, block_size: int) -> AttentionMetadata:
        width, tokens = -(-context_len // block_size), batch * self.query_len
        meta = AttentionMetadata(self.slot_mapping[:tokens], self.block_tables[:batch, :width], self.seq_lens[:batch],
                                 self.query_start_loc[:batch + 1], self.query_len, context_len)
        if self.group_block_tables is not None:
            meta.group_slot_mappings = self.group_slot_mappings[:, :tokens]
            meta.group_block_tables = self.group_block_tables[:, :batch, :width]
        if self.state_indices is not None:
            meta.state_indices = self.state_indices[:batch]
            meta.has_initial_state = self.has_initial_state[:batch]
        return meta


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_model_len: int, block_size: int, device: torch.device,
                 capture: bool = True, split_key: SplitKey | None = None, num_kv_groups: int = 1,
                 query_len: int = 1, has_state: bool = False, backend=None, strict: bool = False) -> None:
        """`has_state`: a hybrid model; `bind_state_padding` names the padding slot once the pool exists.
        `backend`: the graph backend (engine/worker/graphs/backend.py; CUDA graphs on a card by default, a
        stand-in in CPU tests); `strict`: a failed capture raises instead of leaving decode eager (tests)."""
        self.model = model
        self.query_len = q = query_len  # 1 for decode steps, 1 + k for speculative verify steps
        self.ladder = batch_size_ladder(max_batch)
        self.max_batch = self.ladder[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.contexts = {b: context_buckets(b, max_model_len, block_size, split_key, q) for b in self.ladder}
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.backend = backend  # None: CUDA graphs, made when capturing
        self.capture_graphs = capture and (backend is not None or device.type == "cuda")
        self.strict = strict
        self.capture_seconds = 0.0  # wall time of the captures themselves (warm-up forwards excluded)
        b = self.max_batch
        with torch.device(device):
            self.buffers = StaticBuffers(
                input_ids=torch.zeros(b * q, dtype=torch.long), positions=torch.zeros(b * q, dtype=torch.long),
                slot_mapping=torch.full((b * q,), -1, dtype=torch.long),
                block_tables=torch.zeros(b, self.max_blocks, dtype=torch.int32),
                seq_lens=torch.full((b,), q, dtype=torch.int32),
                query_start_loc=torch.arange(b + 1, dtype=torch.int32) * q, query_len=q)
            if num_kv_groups > 1:
                self.buffers.group_slot_mappings = torch.full((num_kv_groups - 1, b * q), -1, dtype=torch.long)
                self.buffers.group_block_tables = torch.zeros(num_kv_groups - 1, b, self.max_blocks, dtype=torch.int32)
            if has_state:
                self.buffers.state_indices = torch.zeros(b, dtype=torch.int32)
                self.buffers.has_initial_state = torch.zeros(b, dtype=torch.bool)
        self.staging = GraphStaging(self.buffers, q, device)  # pinned mirrors: host memory, outside the device scope
        self.state_padding_slot: int | None = None
        self.graphs: dict[tuple[int, int], object] = {}  # (batch, context length) -> the backend's graph
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool_bytes = 0

    def bind_state_padding(self, slot: int) -> None:
        """The state slot padding rows use: one past the pool's, held by no sequence (the runner allocates it)."""
        self.state_padding_slot = slot
        self.buffers.state_indices.fill_(slot)
        self.buffers.has_initial_state.fill_(False)

    def can_run(self, inputs) -> bool:
        num_seqs = len(inputs.seq_lens)  # with max_query_len == query_len, this count means every row is full
        if self.buffers.state_indices is not None and (self.state_padding_slot is None
                                                       or inputs.state_indices is None):
            return False  # a hybrid model before its state pool exists (or the profiling run)
        return (inputs.max_query_len == self.query_len and len(inputs.input_ids) == num_seqs * self.query_len
                and num_seqs <= self.max_batch and inputs.width <= self.max_blocks)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch, context) pair, largest first so the smaller graphs reuse its memory pool;
        on any failure drop them all and stay eager (one log line; strict: raise), rather than stop the engine."""
        if not self.capture_graphs:
            return
        if self.buffers.state_indices is not None and self.state_padding_slot is None:
            raise RuntimeError("decode graphs of a hybrid model: the state pool's padding slot is not bound")
        cuda = self.device.type == "cuda"
        if cuda:
            # Reserved, not allocated, bytes: the intermediates a graph frees during capture stay in its private
            # pool (reserved for replays) but no longer count as allocated, which would leave only the outputs.
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self.device)
        keys = [(b, c) for b in reversed(self.ladder) for c in reversed(self.contexts[b])]
        if self.backend is None:
            self.backend = CudaGraphBackend(self.device)
        try:
            self._capture_all(keys)
        except Exception as e:  # noqa: BLE001 - any capture error means "run eagerly", never a dead engine
            self.graphs.clear()
            self.outputs.clear()
            self.capture_graphs = False
            if cuda:
                torch.cuda.synchronize(self.device)
            if self.strict:
                raise
            logger.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly (slower, same results)",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return
        self.backend.finish()
        if cuda:
            torch.cuda.empty_cache()  # the warm-up forwards' blocks in the ordinary pool: not the graphs'
            self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("captured %d CUDA graphs (%s, batch sizes %s, context lengths %s), %.0f MiB in %.1f s",
                    len(self.graphs), "decode" if self.query_len == 1 else f"verify, {self.query_len} tokens per row",
                    self.ladder, sorted({c for cs in self.contexts.values() for c in cs}), self.pool_bytes / 2**20,
                    self.capture_seconds)

    def _capture_all(self, keys: list[tuple[int, int]]) -> None:
        self.backend.start()  # one memory pool for the set
        for batch, context in tqdm(keys, desc="Capturing CUDA graphs", unit="graph"):
            meta, tokens = self.buffers.meta(batch, context, self.block_size), batch * self.query_len
            self.model(self.buffers.input_ids[:tokens], self.buffers.positions[:tokens], meta)  # warm-up, compiles
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            error, start = None, time.perf_counter()
            try:
                with self.backend.graph() as graph:
                    out = self.model(self.buffers.input_ids[:tokens], self.buffers.positions[:tokens], meta)
            except Exception as e:  # noqa: BLE001 - decided together with the other ranks just below
                error = e
            self.capture_seconds += time.perf_counter() - start
            # Under tensor parallel every rank stops at the same graph (a capture only records its all-reduces;
            # this one runs), so the eager forwards that follow keep pairing up across ranks.
            failed = all_reduce(torch.tensor([error is not None], dtype=torch.int32, device=self.device))
            if error is not None:
                raise error
            if int(failed.item()):
                raise RuntimeError("another tensor-parallel rank could not capture this graph")
            self.graphs[batch, context] = graph
            self.outputs[batch, context] = out

    def run(self, inputs, tables: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[num_seqs × query_len, hidden]`` of a decode (verify) batch through the padded static
        buffers; `tables`: the step's ``[num_groups, num_seqs, width]`` block tables, already on the device;
        `input_ids`: the ids already on the device (async scheduling), else copied from `inputs`."""
        n = len(inputs.seq_lens)
        batch = next(b for b in self.ladder if b >= n)
        needed = max(int(inputs.max_seq_len), inputs.width * self.block_size)
        context = next((c for c in self.contexts[batch] if c >= needed), self.contexts[batch][-1])
        self._fill(inputs, tables, n, batch, input_ids)
        real, tokens = n * self.query_len, batch * self.query_len
        if (batch, context) in self.graphs:
            self.backend.replay(self.graphs[batch, context])
            return self.outputs[batch, context][:real]
        meta = self.buffers.meta(batch, context, self.block_size)
        return self.model(self.buffers.input_ids[:tokens], self.buffers.positions[:tokens], meta)[:real]

    def _fill(self, inputs, tables: torch.Tensor, n: int, batch: int, input_ids: torch.Tensor | None = None) -> None:
        buf = self.buffers
        width = tables.shape[2]
        real, tokens = n * self.query_len, batch * self.query_len  # token rows; n and batch count sequences
        self.staging.fill(inputs, n, batch)  # ids, positions, slots, lengths and offsets, padding rows included
        if input_ids is not None:  # ids the device wrote (async scheduling), over the host's placeholders
            buf.input_ids[:real].copy_(input_ids, non_blocking=True)
        buf.block_tables[:n, :width].copy_(tables[0], non_blocking=True)
        buf.block_tables[:n, width:] = 0
        if buf.group_block_tables is not None:
            buf.group_slot_mappings[:, :real].copy_(torch.as_tensor(inputs.group_slot_mappings), non_blocking=True)
            buf.group_block_tables[:, :n, :width].copy_(tables[1:], non_blocking=True)
            buf.group_block_tables[:, :n, width:] = 0
            buf.group_slot_mappings[:, real:tokens] = -1
            buf.group_block_tables[:, n:batch] = 0
        if buf.state_indices is not None:  # in-place state update through the slots: real rows, then padding
            buf.state_indices[:n].copy_(torch.as_tensor(inputs.state_indices), non_blocking=True)
            buf.has_initial_state[:n].copy_(torch.as_tensor(inputs.has_initial_state), non_blocking=True)
            buf.state_indices[n:batch] = self.state_padding_slot
            buf.has_initial_state[n:batch] = False
        # Padding rows' token rows, past the last sequence, are left as the kernels leave them and discarded.
        if batch > n:
            buf.block_tables[n:batch] = 0
