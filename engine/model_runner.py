"""ModelRunner: builds the model (this rank's shard of it) and its KV cache on one device and runs one batch.

`prepare` turns a scheduled batch into flat arrays (input_ids, positions, slot_mapping, block_tables,
seq_lens, query_start_loc, logits rows, block copies) as plain numpy, so rank 0 can ship the same
`StepInputs` to tensor-parallel workers; `run` moves them to the device, applies copy-on-write block
copies, runs the model once over all of it, computes logits only for the last position of each
sequence that samples this step and samples them on the device (as nano-vllm does), returning token ids
and the logprobs asked for. It never talks to other processes itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from engine.cuda_graphs import DecodeGraphs, triton_split_key
from engine.distributed import get_tp_size
from engine.gpu_baseline import free_bytes_at_start
from engine.kv_cache_interface import model_kv_layout
from engine.layers.attention import AttentionMetadata
from engine.loader import iterate_weights
from engine.model_config import ModelConfig
from engine.models.registry import model_class
from engine.prompt_logprobs import PromptLogprobsOutput, compute_prompt_logprobs, prompt_positions
from engine.sampler import SamplerOutput, beam_top_logprobs, sample_on_device
from engine.sampling_metadata import SamplingBatch, SamplingMetadata
from engine.scheduler import ScheduledSeq
from engine.profiling import profile_batch, profile_sampling_batch
from engine.sizing import estimate_graph_bytes
from engine.warm_up import warm_up_kernels

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
logger = logging.getLogger("pagedesk.engine")
WARM_UP_MAX_BATCH = 256  # without graphs, warm up decode batches up to this (covers every split count)
TORCH_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                "half": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu")
    return indexed_device(torch.device(device))


def indexed_device(device: torch.device) -> torch.device:
    """A bare "cuda" as "cuda:N", the current card. Tensors made on "cuda" report cuda:N, but a generator
    made on it keeps no index, and the sampler refuses a generator whose device differs from the logits'."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
    prompt_logits_rows: list[int] = field(default_factory=list)  # token rows whose next prompt token is scored
    prompt_targets: list[int] = field(default_factory=list)  # that next prompt token, per row
    prompt_logprobs_k: int = 0  # top-k width asked by the step's prompt-logprobs requests
    # KV cache groups past the first (models with sliding-window layers): their tables and slots, same shapes.
    group_block_tables: np.ndarray | None = None  # [num_groups - 1, num_seqs, max_blocks] int32
    group_slot_mappings: np.ndarray | None = None  # [num_groups - 1, num_tokens] int64


@dataclass(slots=True)
class ModelRunnerOutput:
    """What a step hands back to the engine: host-side and small, never `[batch, vocab]` logits."""

    sampled: SamplerOutput | None = None  # one entry per SamplingBatch row
    beam_logprobs: list[list[float]] | None = None  # per beam row: its top next-token log-probs, best first
    beam_ids: list[list[int]] | None = None  # and their token ids
    prompt_logprobs: PromptLogprobsOutput | None = None  # over StepInputs.prompt_logits_rows, in order


def every_shape(*shape):
    """A kernel-configuration key that tells every shape apart. Under tensor parallel each rank must capture
    and warm up the very same shapes, in the same order, or their all-reduces would not pair up; a key
    from the card's own SM count could differ between a 3090 and a 4090."""
    return shape


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_path, device: torch.device, dtype: torch.dtype,
                 block_size: int, attention_backend: str) -> None:
        device = indexed_device(device)
        self.config = model_config
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.attention_backend = attention_backend
        # Free memory before our weights and our CUDA context, so sizing can tell what other programs hold.
        self.free_bytes_at_start, self.total_bytes = free_bytes_at_start(device.index) if device.type == "cuda" \
            else (0, 0)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = model_class(model_config.architecture)(model_config, attention_backend)
        finally:
            torch.set_default_dtype(torch.float32)
        self.model.load_weights(iterate_weights(model_path, device="cpu"))
        self.model.eval()
        self.kv_layout = model_kv_layout(model_config, block_size)  # the engine's KVCacheManager reads the same
        self.kv_cache: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """One tensor per cache slot (engine/kv_cache_interface.py): a layer uses its slot's K/V with the block
        table of its group; without sliding windows that is one slot per layer and a single group."""
        attn = self.model.attention_layers()
        layout = self.kv_layout
        shape = (layout.num_slots, 2, num_blocks, self.block_size, attn[0].num_kv_heads, attn[0].head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        for layer, slot, group in zip(attn, layout.layer_slots, layout.layer_groups):
            # Layers may differ in heads x head_dim (Gemma 4), never in page size: each views its slot its way.
            page = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_cache(self.kv_cache[slot, 0].view(page), self.kv_cache[slot, 1].view(page))
            layer.kv_group = group

    def release_kv_cache(self) -> None:
        """Drop the cache (the profiling run's temporary one); layers then skip attention until rebound."""
        self.kv_cache = None
        for layer in self.model.attention_layers():
            layer.bind_cache(torch.empty(0, device=self.device), torch.empty(0, device=self.device))

    def plan_decode_graphs(self, max_batch: int, capture: bool = True) -> None:
        """Decode steps of up to `max_batch` sequences will replay CUDA graphs (captured after the KV cache
        exists); `capture=False` runs the same padded path eagerly, which is how CPU tests exercise it."""
        split_key = triton_split_key(self.model, self.device) if self.attention_backend == "triton" else None
        if split_key is not None and get_tp_size() > 1:
            split_key = every_shape  # tile choices follow each card's SM count; the graphs must not differ
        self.graphs = DecodeGraphs(self.model, max_batch, self.config.max_model_len, self.block_size, self.device,
                                   capture, split_key, len(self.kv_layout.groups))

    def capture_decode_graphs(self) -> None:
        """After the KV cache exists: capture the decode graphs, then compile the Triton variants the
        serving path will meet (engine/warm_up.py), so the first requests do not wait for them."""
        if self.graphs is not None:
            planned = self.graph_bytes()  # the estimate the KV pool was sized around
            self.graphs.capture()
            if self.graphs.pool_bytes > planned:
                logger.warning("CUDA graphs took %.0f MiB, %.0f MiB more than the KV sizing planned for; lower "
                               "--gpu-memory-utilization if the card runs out of memory", self.graphs.pool_bytes
                               / 2**20, (self.graphs.pool_bytes - planned) / 2**20)
        if self.device.type == "cuda" and self.attention_backend == "triton":
            max_batch = self.graphs.max_batch if self.graphs is not None else WARM_UP_MAX_BATCH
            warm_up_kernels(self.model, max_batch, self.config.max_model_len, self.block_size, self.device,
                            every_shape if get_tp_size() > 1 else None)

    def graph_bytes(self) -> int:
        """CUDA-graph memory: measured once captured, estimated before (so the KV pool is sized around it)."""
        if self.graphs is None or not self.graphs.capture_graphs:
            return 0
        if self.graphs.graphs:
            return self.graphs.pool_bytes
        return estimate_graph_bytes(self.config, self.graphs.max_batch, self.dtype.itemsize, get_tp_size())

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
        tables = self._block_table_array([item.seq.block_table for item in batch])
        query_start = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        num_tokens = int(query_start[-1])
        owner = np.repeat(np.arange(len(batch)), num_new)  # which sequence each token row belongs to
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - computed, num_new)
        block_index, offset = positions // bs, positions % bs
        slots = tables[owner, block_index].astype(np.int64) * bs + offset
        group_tables = group_slots = None
        if len(self.kv_layout.groups) > 1:  # every group's table has the same length: same shapes
            group_tables = np.stack([self._block_table_array([item.seq.block_tables[g] for item in batch])
                                     for g in range(1, len(self.kv_layout.groups))])
            group_slots = group_tables[:, owner, block_index].astype(np.int64) * bs + offset
        input_ids = np.fromiter(chain.from_iterable(
            item.seq.token_ids[item.seq.num_computed_tokens:item.seq.num_computed_tokens + item.num_new_tokens]
            for item in batch), np.int64, num_tokens)
        seq_lens = (computed + num_new).astype(np.int32)
        prompt_rows, prompt_targets, prompt_k = self._prompt_logits_rows(batch, computed, query_start)
        return StepInputs(
            input_ids=input_ids, positions=positions, slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
            query_start_loc=query_start.astype(np.int32), logits_rows=(query_start[1:][samples] - 1).tolist(),
            max_query_len=int(num_new.max()), max_seq_len=int(seq_lens.max()), block_copies=list(block_copies),
            prompt_logits_rows=prompt_rows, prompt_targets=prompt_targets, prompt_logprobs_k=prompt_k,
            group_block_tables=group_tables, group_slot_mappings=group_slots)

    @staticmethod
    def _block_table_array(block_tables: list[list]) -> np.ndarray:
        """[num_seqs, longest table] block ids, zero-padded (window groups' freed entries are NULL_BLOCK: 0)."""
        block_ids = [[b.block_id for b in table] for table in block_tables]
        table_lens = np.fromiter(map(len, block_ids), np.int64, len(block_ids))
        tables = np.zeros((len(block_ids), int(table_lens.max())), dtype=np.int32)
        tables[np.arange(tables.shape[1]) < table_lens[:, None]] = np.fromiter(chain.from_iterable(block_ids),
                                                                               np.int32, int(table_lens.sum()))
        return tables

    @staticmethod
    def _prompt_logits_rows(batch: list[ScheduledSeq], computed: np.ndarray,
                            query_start: np.ndarray) -> tuple[list[int], list[int], int]:
        """Token rows whose logits score the next prompt token (requests with prompt_logprobs), their targets,
        and the widest top-k asked."""
        rows, targets, k = [], [], 0
        for i, item in enumerate(batch):
            scored = prompt_positions(item.seq, int(computed[i]), item.num_new_tokens)
            if scored:
                first_row = int(query_start[i]) - int(computed[i])
                rows += [first_row + p for p in scored]
                targets += item.seq.token_ids[scored.start + 1:scored.stop + 1]
                k = max(k, item.seq.request.params.prompt_logprobs)
        return rows, targets, k

    @torch.inference_mode()
    def run(self, inputs: StepInputs, sampling: SamplingBatch | None = None) -> ModelRunnerOutput | None:
        """One forward over prepared inputs, then sampling on the device; the small results on the host.

        Under tensor parallelism every rank runs this with the same inputs (the collectives pair up, the LM
        head's all-gather included); only rank 0 passes `sampling`, the others get None back."""
        self.copy_blocks(inputs.block_copies)
        dev = self.device
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)  # copies into its static buffers: no metadata tensors to make
        else:
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(inputs.slot_mapping).to(dev),
                block_tables=torch.from_numpy(inputs.block_tables).to(dev),
                seq_lens=torch.from_numpy(inputs.seq_lens).to(dev),
                query_start_loc=torch.from_numpy(inputs.query_start_loc).to(dev),
                max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len)
            if inputs.group_block_tables is not None:
                meta.group_block_tables = torch.from_numpy(inputs.group_block_tables).to(dev)
                meta.group_slot_mappings = torch.from_numpy(inputs.group_slot_mappings).to(dev)
            hidden = self.model(torch.from_numpy(inputs.input_ids).to(dev),
                                torch.from_numpy(inputs.positions).to(dev), meta)
        prompt_logprobs = None
        if inputs.prompt_logits_rows:
            prompt_logprobs = compute_prompt_logprobs(hidden, inputs.prompt_logits_rows, inputs.prompt_targets,
                                                      inputs.prompt_logprobs_k, self.model.compute_logits,
                                                      reduce=sampling is not None)
        if not inputs.logits_rows:
            return None if sampling is None else ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[torch.as_tensor(inputs.logits_rows, device=dev)])
        if sampling is None:
            return None
        out = self.sample(logits, sampling)
        out.prompt_logprobs = prompt_logprobs
        return out

    @staticmethod
    def sample(logits: torch.Tensor, sampling: SamplingBatch) -> ModelRunnerOutput:
        """Draw the batch's tokens and take beam rows' top log-probs, all on the logits' device."""
        out, dev = ModelRunnerOutput(), logits.device
        if sampling.rows:
            meta = SamplingMetadata.build(sampling.rows, logits.shape[1], dev)
            if sampling.bitmask is not None:
                meta.bitmask = sampling.bitmask.to(dev, non_blocking=True)
            rows = logits[torch.as_tensor(sampling.logits_index, device=dev)]
            out.sampled = sample_on_device(rows, meta, sampling.generator).to_host()
        if sampling.beam_index:
            values, ids = beam_top_logprobs(logits[torch.as_tensor(sampling.beam_index, device=dev)],
                                            sampling.beam_topk)
            # One copy; token ids < 2**53 stay exact in float64.
            out.beam_logprobs, ids = torch.stack([values.double(), ids.double()]).cpu().tolist()
            out.beam_ids = [[int(t) for t in row] for row in ids]
        return out

    def execute(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]],
                sampling: SamplingBatch | None = None) -> ModelRunnerOutput | None:
        """Run the batch and sample what `sampling` asks for."""
        return self.run(self.prepare(batch, block_copies), sampling)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int, kv_dtype: torch.dtype) -> int:
        """One step at the memory peak: prefills of `num_tokens` dummy tokens through the real attention
        path against a temporary KV cache, logits for max_num_seqs rows, then `sample` over them at the
        sampler's widest, with the hidden states and logits still held as `run` holds them. Returns the
        temporary cache's bytes (the real pool replaces them)."""
        batch = profile_batch(num_tokens, max_num_seqs, self.config.max_model_len, self.block_size)
        self.allocate_kv_cache(batch.num_blocks, kv_dtype)
        temporary_kv_bytes = self.kv_cache_bytes()
        try:
            hidden = self.model(torch.from_numpy(batch.input_ids).to(self.device),
                                torch.from_numpy(batch.positions).to(self.device), batch.metadata(self.device))
            rows = torch.arange(len(hidden) - max_num_seqs, len(hidden), device=self.device).clamp_(min=0)
            logits = self.model.compute_logits(hidden[rows])
            self.sample(logits, profile_sampling_batch(max_num_seqs, logits.shape[1], self.device))
            del hidden, logits  # only now: a real step holds both until sampling is done
        finally:
            self.release_kv_cache()
        return temporary_kv_bytes

    def profile_memory(self, num_tokens: int, max_num_seqs: int, kv_dtype: torch.dtype) -> list:
        """This card's MemoryProfile after a profiling step (a list: one entry per rank, like the executor)."""
        from engine.kv_cache_sizing import measure_memory
        return [measure_memory(self, num_tokens, max_num_seqs, kv_dtype)]

    def check_health(self) -> None:
        """Nothing to check on one device (the tensor-parallel executor checks its workers)."""

    def shutdown(self) -> None:
        """Nothing to stop on one device: the model and KV cache go with this object."""
