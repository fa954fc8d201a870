"""ModelRunner: builds the model (this rank's shard of it) and its KV cache on one device and runs one batch.

`prepare` turns a scheduled batch into flat arrays (input_ids, positions, slot_mapping, block_tables,
seq_lens, query_start_loc, logits rows, block copies) as plain numpy, so rank 0 can ship the same
`StepInputs` to tensor-parallel workers; `run` moves them to the device, applies copy-on-write block
copies, runs the model once over all of it and computes logits only for the last position of each
sequence that samples this step. It never samples and never talks to other processes itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.cuda_graphs import DecodeGraphs
from engine.layers.attention import AttentionMetadata
from engine.loader import iterate_weights
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.scheduler import ScheduledSeq
from engine.sizing import estimate_activation_bytes

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
GRAPH_OVERHEAD_BYTES = 2 * 2**20  # per captured graph: kernel parameters and bookkeeping (an estimate)
TORCH_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                "half": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, model_dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if model_dtype in ("float16", "bfloat16"):
        return TORCH_DTYPES[model_dtype]
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    return KV_CACHE_DTYPES.get(kv_cache_dtype, dtype)


@dataclass(slots=True)
class StepInputs:
    """One step's flat model inputs, device-free and picklable (what rank 0 sends each worker)."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    logits_rows: list[int]  # token row of each sampling sequence's last position
    max_query_len: int
    max_seq_len: int
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst) block ids, applied before the forward


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_path, device: torch.device, dtype: torch.dtype,
                 block_size: int, attention_backend: str) -> None:
        self.config = model_config
        self.device, self.dtype, self.block_size = device, dtype, block_size
        # Free memory before our weights, so sizing can tell what the desktop and other programs hold.
        self.free_bytes_at_start, self.total_bytes = torch.cuda.mem_get_info(device) if device.type == "cuda" \
            else (0, 0)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = DecoderForCausalLM(model_config, attention_backend)
        finally:
            torch.set_default_dtype(torch.float32)
        self.model.load_weights(iterate_weights(model_path, device="cpu"))
        self.model.eval()
        self.kv_cache: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        attn = self.model.attention_layers()
        shape = (len(attn), 2, num_blocks, self.block_size, attn[0].num_kv_heads, attn[0].head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        for i, layer in enumerate(attn):
            layer.bind_cache(self.kv_cache[i, 0], self.kv_cache[i, 1])

    def plan_decode_graphs(self, max_batch: int, capture: bool = True) -> None:
        """Decode steps of up to `max_batch` sequences will replay CUDA graphs (captured after the KV cache
        exists); `capture=False` runs the same padded path eagerly, which is how CPU tests exercise it."""
        self.graphs = DecodeGraphs(self.model, max_batch, self.config.max_model_len, self.block_size, self.device,
                                   capture)

    def capture_decode_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()

    def graph_bytes(self) -> int:
        """CUDA-graph memory: measured once captured, estimated before (so the KV pool is sized around it)."""
        if self.graphs is None or not self.graphs.capture_graphs:
            return 0
        if self.graphs.graphs:
            return self.graphs.pool_bytes
        return estimate_activation_bytes(self.config, self.graphs.max_batch, self.dtype.itemsize) + \
            GRAPH_OVERHEAD_BYTES * len(self.graphs.ladder)

    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies and self.kv_cache is not None:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            cache = self.kv_cache.view(torch.uint8) if self.kv_cache.element_size() == 1 else self.kv_cache
            cache[:, :, dst] = cache[:, :, src]

    def prepare(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]] = ()) -> StepInputs:
        """Flat, device-free inputs for the whole batch, with the row of each sampling sequence's last token.

        One Python pass collects each sequence's numbers; positions, slots and offsets are numpy over the batch."""
        bs = self.block_size
        num_new = np.fromiter((item.num_new_tokens for item in batch), np.int64, len(batch))
        computed = np.fromiter((item.seq.num_computed_tokens for item in batch), np.int64, len(batch))
        samples = np.fromiter((item.samples for item in batch), bool, len(batch))
        block_ids = [[b.block_id for b in item.seq.block_table] for item in batch]
        table_lens = np.fromiter(map(len, block_ids), np.int64, len(batch))
        tables = np.zeros((len(batch), int(table_lens.max())), dtype=np.int32)
        tables[np.arange(tables.shape[1]) < table_lens[:, None]] = np.fromiter(chain.from_iterable(block_ids),
                                                                               np.int32, int(table_lens.sum()))
        query_start = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        num_tokens = int(query_start[-1])
        owner = np.repeat(np.arange(len(batch)), num_new)  # which sequence each token row belongs to
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - computed, num_new)
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        input_ids = np.fromiter(chain.from_iterable(
            item.seq.token_ids[item.seq.num_computed_tokens:item.seq.num_computed_tokens + item.num_new_tokens]
            for item in batch), np.int64, num_tokens)
        seq_lens = (computed + num_new).astype(np.int32)
        return StepInputs(
            input_ids=input_ids, positions=positions, slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
            query_start_loc=query_start.astype(np.int32), logits_rows=(query_start[1:][samples] - 1).tolist(),
            max_query_len=int(num_new.max()), max_seq_len=int(seq_lens.max()), block_copies=list(block_copies))

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """One forward over prepared inputs; float32 logits ``[len(logits_rows), vocab]``.

        Under tensor parallelism every rank runs this with the same inputs (the collectives pair up)."""
        self.copy_blocks(inputs.block_copies)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(inputs.slot_mapping).to(dev),
            block_tables=torch.from_numpy(inputs.block_tables).to(dev),
            seq_lens=torch.from_numpy(inputs.seq_lens).to(dev),
            query_start_loc=torch.from_numpy(inputs.query_start_loc).to(dev),
            max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len)
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
        else:
            hidden = self.model(torch.from_numpy(inputs.input_ids).to(dev),
                                torch.from_numpy(inputs.positions).to(dev), meta)
        if not inputs.logits_rows:
            return torch.empty(0, self.config.vocab_size)
        return self.model.compute_logits(hidden[inputs.logits_rows]).float()

    def execute(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]]) -> torch.Tensor:
        """Run the batch; return float32 logits ``[num_sampling_seqs, vocab]`` in batch order."""
        return self.run(self.prepare(batch, block_copies))

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A forward over `num_tokens` dummy tokens without attention, to measure peak activation memory."""
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device) % self.config.max_position_embeddings
        hidden = self.model(ids, pos, None)
        self.model.compute_logits(hidden[-min(num_tokens, 256):])

    def profile_memory(self, num_tokens: int) -> list:
        """This card's MemoryProfile after a profiling forward (a list: one entry per rank, like the executor)."""
        from engine.kv_cache_sizing import measure_memory
        return [measure_memory(self, num_tokens)]

    def check_health(self) -> None:
        """Nothing to check on one device (the tensor-parallel executor checks its workers)."""

    def shutdown(self) -> None:
        """Nothing to stop on one device: the model and KV cache go with this object."""
