"""ModelRunner: builds the model (this rank's shard of it) and its KV cache on one device and runs one batch.

`prepare` turns a scheduled batch into flat arrays (input_ids, positions, slot_mapping, seq_lens,
query_start_loc, logits rows, block copies) as plain numpy, and brings the persistent input batch's block
tables up to date (engine/worker/input_batch.py), keeping the diff, so rank 0 can ship the same small `StepInputs` to
tensor-parallel workers (engine/worker/step_inputs.py); `run` applies copy-on-write block copies, issues every host -> device copy of the
step (asynchronous on a card, the sampler's tensors included) before the forward, runs the model once over
all of it, computes logits only for the last position of each sequence that samples this step and samples
them on the device (as nano-vllm does), returning token ids and the logprobs asked for. It never talks to
other processes itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.worker.graphs.decode import DecodeGraphs, triton_split_key
from engine.worker.graphs.piecewise import PiecewiseGraphs
from engine.platform.devices import indexed_device
from engine.distributed.parallel_state import get_tp_rank, get_tp_size
from engine.worker.gpu_baseline import free_bytes_at_start
from engine.worker.step_inputs import ModelRunnerOutput, StepInputs, logits_rows, query_tokens
from engine.worker.input_batch import InputBatch
from engine.platform.host_copies import to_device
from engine.kv.kv_cache_interface import cdiv, model_kv_layout
from engine.layers.attention import AttentionMetadata
from engine.layers.fused_moe.expert_load import ExpertLoad
from engine.worker.loader import iterate_weights
from engine.config.model import ModelConfig
from engine.models.registry import model_class
from engine.sample.pooling import drop_lm_head, embedding_weights, pool_hidden, pooling_spans
from engine.sample.prompt_logprobs import compute_prompt_logprobs, prompt_positions
from engine.sample.sampler import beam_top_logprobs, sample_on_device
from engine.sample.metadata import SamplingBatch
from engine.sample.state import SamplingMetadata
from engine.sample.state import FIRST_ROWS, SamplingState
from engine.core.scheduler import ScheduledSeq
from engine.sample.rejection_sampler import prepare_verify, verify_drafts
from engine.spec_decode.state_rollback import StateReplay, VerifyStates
from engine.worker.profiling import profile_batch, profile_sampling_batch
from engine.planning.graphs import VERIFY_GRAPH_MAX_BATCH, estimate_graph_bytes, estimate_piecewise_graph_bytes
from engine.worker.warm_up import warm_up_kernels

logger = logging.getLogger("pagedesk.engine")
WARM_UP_MAX_BATCH = 256  # without graphs, warm up decode batches up to this (covers every split count)
@dataclass(slots=True)
class PreparedSampling:
    """A SamplingBatch's device tensors, made before the forward."""

    batch: SamplingBatch
    meta: SamplingMetadata | None = None
    rows_index: torch.Tensor | None = None  # logits row of each sampling row
    beam_index: torch.Tensor | None = None
    spec: tuple | None = None  # speculative verify rows' (SamplingMetadata, logits index)


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
        weights = iterate_weights(model_path, device="cpu")
        if model_config.pooler is not None:  # an embedding engine: no LM head (engine/sample/pooling.py)
            drop_lm_head(self.model)
            weights = embedding_weights(weights, self.model)
        self.model.load_weights(weights)
        self.model.eval()
        # Routed tokens per (MoE layer, expert), on the device; every rank routes alike, rank 0 counts.
        self.expert_load = ExpertLoad.bind(self.model, device) if get_tp_rank() == 0 else None
        self.kv_layout = model_kv_layout(model_config, block_size)  # the engine's KVCacheManager reads the same
        self.kv_cache: torch.Tensor | None = None
        # The last step's hidden states (the model's output, after its final norm), kept for an MTP head
        # (engine/spec_decode/proposers/mtp.py) until it has read them; off otherwise.
        self.keep_hidden, self.last_hidden = False, None
        self.state_cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # per linear-attention layer: conv, ssm
        self.verify_states = VerifyStates()  # speculative verify rows of a hybrid model (rank 0 plans them)
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # speculative verify steps: 1 + k tokens per row
        self.piecewise: PiecewiseGraphs | None = None  # prompt and mixed steps (engine/worker/graphs/piecewise.py)
        # Rank 0 updates it from the scheduled batch; a tensor-parallel worker's follows rank 0's diffs.
        self.input_batch = InputBatch(len(self.kv_layout.groups), cdiv(model_config.max_model_len, block_size),
                                      device)
        # Rank 0's per-row sampling parameters and penalty counts, made at its first sampling step (a
        # tensor-parallel worker never samples, so never holds one).
        self.sampling_state: SamplingState | None = None
        self.max_num_seqs = 0

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def expert_load_totals(self) -> dict | None:
        """Routed token assignments per MoE layer and expert since start (ExpertLoad.totals; one small device ->
        host copy, between steps), None for a dense model."""
        return None if self.expert_load is None else self.expert_load.totals()

    def reserve_input_rows(self, max_num_seqs: int) -> None:
        """The input batch's rows for every sequence the scheduler may run, before the KV pool is sized."""
        self.input_batch.reserve(max_num_seqs)
        self.max_num_seqs = max_num_seqs

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype, num_state_slots: int = 0) -> None:
        """One tensor per cache slot (engine/kv/kv_cache_interface.py): a layer uses its slot's K/V with the block
        table of its group; without sliding windows that is one slot per layer and a single group. A hybrid
        model's linear-attention layers also get their state pool: `num_state_slots` (max_num_seqs) slots."""
        if self.kv_layout.state is not None and num_state_slots:  # not the profiling run's temporary cache
            self.allocate_state_cache(num_state_slots)
        attn = self.model.attention_layers()
        layout = self.kv_layout
        shape = (layout.num_slots, 2, num_blocks, self.block_size, attn[0].num_kv_heads, attn[0].head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        for layer, slot, group in zip(attn, layout.layer_slots, layout.layer_groups):
            # Layers may differ in heads x head_dim (Gemma 4), never in page size: each views its slot its way.
            page = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_cache(self.kv_cache[slot, 0].view(page), self.kv_cache[slot, 1].view(page))
            layer.kv_group = group

    def allocate_state_cache(self, num_slots: int) -> None:
        """Per linear-attention layer a conv state [num_slots, C, K-1] in the model dtype and a recurrent state
        [num_slots, Hv, Dk, Dv] in mamba_ssm_dtype (float32), zeroed; each layer reads and writes them in place
        through the sequences' slot indices. With decode graphs one more slot, `num_slots`, is the graphs'
        padding slot: padding rows update it, no sequence ever holds it."""
        spec = self.kv_layout.state.spec
        ssm_dtype = {4: torch.float32, 2: torch.bfloat16}[spec.ssm_dtype_bytes]
        total = num_slots + (self.graphs is not None)
        self.state_cache = []
        for layer in self.model.state_layers():  # this rank's heads and channels (the layer knows its split)
            conv = torch.zeros((total, layer.conv_state_channels, layer.conv_kernel - 1), dtype=self.dtype,
                               device=self.device)
            ssm = torch.zeros((total, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim), dtype=ssm_dtype,
                              device=self.device)
            layer.bind_state(conv, ssm)
            self.state_cache.append((conv, ssm))
        if self.graphs is not None:
            self.graphs.bind_state_padding(num_slots)

    def reserve_verify_tokens(self, num_tokens: int) -> None:
        """A hybrid model under speculative decoding: every linear-attention layer's verify scratch for
        `num_tokens` verify tokens a step (max_num_seqs * (1 + k)), before the KV pool is sized."""
        if self.kv_layout.state is None or num_tokens <= 0:
            return
        for layer in self.model.state_layers():
            layer.reserve_verify_rows(num_tokens, self.dtype, self.device)
        self.verify_states.max_rows = num_tokens

    def replay_verified(self, replay: StateReplay | None) -> None:
        """The previous verify step's accepted tokens folded into their state slots (before any state copy
        or forward of this step reads them)."""
        if replay is None or not self.state_cache:
            return
        dev = self.device
        rows = to_device(torch.from_numpy(replay.rows), dev)
        query_start = to_device(torch.from_numpy(replay.query_start_loc), dev)
        slots = to_device(torch.from_numpy(replay.state_indices), dev)
        for layer in self.model.state_layers():
            layer.replay(rows, query_start, slots, replay.max_query_len)

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """State copies (forks, prefix-cache snapshots taken and restored) in the order they were made: a
        snapshot taken in one step and restored in the next is read after it was written."""
        if copies and self.state_cache:
            for src, dst in copies:
                for conv, ssm in self.state_cache:
                    conv[dst].copy_(conv[src])
                    ssm[dst].copy_(ssm[src])

    def release_kv_cache(self) -> None:
        """Drop the cache (the profiling run's temporary one); layers then skip attention until rebound."""
        self.kv_cache = None
        for layer in self.model.attention_layers():
            layer.bind_cache(torch.empty(0, device=self.device), torch.empty(0, device=self.device))

    def plan_decode_graphs(self, max_batch: int, capture: bool = True, piecewise_tokens: int = 0,
                           verify_query_len: int = 0) -> None:
        """Decode steps of up to `max_batch` sequences will replay CUDA graphs (captured after the KV cache
        exists); `capture=False` runs the same padded path eagerly, which is how CPU tests exercise it. With
        `piecewise_tokens`, the other steps of up to that many tokens replay piecewise graphs (on a card).
        With `verify_query_len` (1 + k under speculative decoding), verify steps whose every row has that many
        tokens replay their own graphs, up to VERIFY_GRAPH_MAX_BATCH sequences. A hybrid model's graphs update
        its state pool in place through static slot indices (a padding slot beside the pool for padding rows);
        on a card that needs the Triton DeltaNet kernels (the torch reference reads the batch layout on the
        host, which a graph cannot replay)."""
        hybrid = self.kv_layout.state is not None
        if hybrid and capture and self.device.type == "cuda" and self.attention_backend != "triton":
            logger.info("CUDA graphs are off for %s: its linear-attention layers run the torch reference "
                        "kernels, which sync with the host (use the triton backend)", self.config.architecture)
            return
        if piecewise_tokens and capture and self.device.type == "cuda":
            self.piecewise = PiecewiseGraphs(self.model, piecewise_tokens, self.device,
                                             num_kv_groups=len(self.kv_layout.groups))
        split_key = triton_split_key(self.model, self.device) if self.attention_backend == "triton" else None
        if split_key is not None and get_tp_size() > 1:
            split_key = every_shape  # tile choices follow each card's SM count; the graphs must not differ
        self.graphs = DecodeGraphs(self.model, max_batch, self.config.max_model_len, self.block_size, self.device,
                                   capture, split_key, len(self.kv_layout.groups), has_state=hybrid)
        # Hybrid models' verify steps keep a recurrent state per draft position: not captured here (yet); their
        # verify rows run eagerly or through the piecewise pieces (engine/spec_decode/state_rollback.py).
        if verify_query_len > 1 and not hybrid:
            self.verify_graphs = DecodeGraphs(self.model, min(max_batch, VERIFY_GRAPH_MAX_BATCH),
                                              self.config.max_model_len, self.block_size, self.device, capture,
                                              split_key, len(self.kv_layout.groups), verify_query_len)

    def capture_decode_graphs(self) -> None:
        """After the KV cache exists: capture the decode graphs, then compile the Triton variants the
        serving path will meet (engine/worker/warm_up.py), so the first requests do not wait for them."""
        if self.graphs is not None:
            planned = self.graph_bytes()  # the estimate the KV pool was sized around
            self.graphs.capture()
            if self.verify_graphs is not None:
                self.verify_graphs.capture()
            if self.piecewise is not None:
                self.piecewise.capture()
            captured = self.graph_bytes()
            if captured > planned:
                logger.warning("CUDA graphs took %.0f MiB, %.0f MiB more than the KV sizing planned for; lower "
                               "--gpu-memory-utilization if the card runs out of memory", captured / 2**20,
                               (captured - planned) / 2**20)
        if self.device.type == "cuda" and self.attention_backend == "triton":
            max_batch = self.graphs.max_batch if self.graphs is not None else WARM_UP_MAX_BATCH
            warm_up_kernels(self.model, max_batch, self.config.max_model_len, self.block_size, self.device,
                            every_shape if get_tp_size() > 1 else None)

    def graph_bytes(self) -> int:
        """CUDA-graph memory: measured once captured, estimated before (so the KV pool is sized around it)."""
        total = 0
        for graphs in (self.graphs, self.verify_graphs):
            if graphs is not None and graphs.capture_graphs:
                total += graphs.pool_bytes if graphs.graphs else estimate_graph_bytes(
                    self.config, graphs.max_batch, self.dtype.itemsize, get_tp_size(), graphs.query_len)
        if self.graphs is not None and self.graphs.capture_graphs:
            total += self.state_slot_bytes()  # a hybrid model's padding slot (0 for the others)
        if self.piecewise is not None and self.piecewise.enabled:
            total += self.piecewise.pool_bytes if self.piecewise.captured else \
                estimate_piecewise_graph_bytes(self.config, self.piecewise.max_tokens, self.dtype.itemsize,
                                               get_tp_size())
        return total

    def state_slot_bytes(self) -> int:
        """One state slot over this rank's linear-attention layers (0 without them)."""
        if self.kv_layout.state is None:
            return 0
        ssm_bytes = self.kv_layout.state.spec.ssm_dtype_bytes
        return sum(layer.conv_state_channels * (layer.conv_kernel - 1) * self.dtype.itemsize
                   + layer.num_v_heads * layer.head_k_dim * layer.head_v_dim * ssm_bytes
                   for layer in self.model.state_layers())

    def kv_cache_bytes(self) -> int:
        """The paged KV cache and a hybrid model's state pool."""
        states = sum(t.numel() * t.element_size() for pair in self.state_cache for t in pair)
        return states + (0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size())

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies and self.kv_cache is not None:
            pairs = to_device(torch.tensor(copies, dtype=torch.long), self.device)
            src, dst = pairs[:, 0], pairs[:, 1]
            cache = self.kv_cache.view(torch.uint8) if self.kv_cache.element_size() == 1 else self.kv_cache
            cache[:, :, dst] = cache[:, :, src]

    def prepare(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]] = (),
                state_copies: list[tuple[int, int]] = ()) -> StepInputs:
        """Flat, device-free inputs for the whole batch, with the row of each sampling sequence's last token.

        The input batch takes only what changed in the block tables; positions, slots and offsets are numpy
        over the batch, the slots read from the input batch's host tables."""
        bs = self.block_size
        num_new = np.fromiter((item.num_new_tokens for item in batch), np.int64, len(batch))
        computed = np.fromiter((item.seq.num_computed_tokens for item in batch), np.int64, len(batch))
        samples = np.fromiter((item.samples for item in batch), bool, len(batch))
        rows, diff = self.input_batch.update(batch)
        width = int(self.input_batch.num_blocks[:, rows].max())
        query_start = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        num_tokens = int(query_start[-1])
        owner = np.repeat(np.arange(len(batch)), num_new)  # which sequence each token row belongs to
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - computed, num_new)
        block_index, offset = positions // bs, positions % bs
        host, token_rows = self.input_batch.host_np, rows[owner]
        slots = host[0, token_rows, block_index].astype(np.int64) * bs + offset
        group_slots = None
        if len(self.kv_layout.groups) > 1:  # every group's table has the same length: same shapes
            group_slots = host[1:, token_rows, block_index].astype(np.int64) * bs + offset
        input_ids = np.fromiter(chain.from_iterable(map(query_tokens, batch)), np.int64, num_tokens)
        seq_lens = (computed + num_new).astype(np.int32)
        prompt_rows, prompt_targets, prompt_k = self._prompt_logits_rows(batch, computed, query_start)
        pool_owners, pool_spans = pooling_spans(batch, computed, query_start) \
            if self.config.pooler is not None else ([], [])
        state_indices = has_initial_state = replay = read_only = verify_rows = None
        if self.kv_layout.state is not None:
            state_indices = np.fromiter((item.seq.state_slot for item in batch), np.int32, len(batch))
            has_initial_state = computed > 0
            self.input_batch.state_slots[rows] = state_indices  # the input batch's per-row state slot
            replay = self.verify_states.take_replay()  # the last verify step's, now that acceptance is known
            read_only, verify_rows = self.verify_states.plan(batch, query_start)
        return StepInputs(
            input_ids=input_ids, positions=positions, slot_mapping=slots, seq_lens=seq_lens,
            query_start_loc=query_start.astype(np.int32), logits_rows=logits_rows(batch, query_start, samples),
            max_query_len=int(num_new.max()), max_seq_len=int(seq_lens.max()), block_copies=list(block_copies),
            prompt_logits_rows=prompt_rows, prompt_targets=prompt_targets, prompt_logprobs_k=prompt_k,
            group_slot_mappings=group_slots, rows=rows, table_width=width, table_diff=diff,
            state_indices=state_indices, has_initial_state=has_initial_state, state_copies=list(state_copies),
            state_replay=replay, state_read_only=read_only, verify_token_rows=verify_rows,
            pool_owners=pool_owners, pool_spans=pool_spans)

    def step_tables(self, inputs: StepInputs) -> torch.Tensor:
        """This step's `[num_groups, num_seqs, width]` block tables on the device. With an input batch: its
        diff applied (a worker; rank 0 applied it in `prepare`), the changed cells copied asynchronously and
        the step's rows gathered on the device."""
        if inputs.block_tables is not None:
            tables = inputs.block_tables[None]
            if inputs.group_block_tables is not None:
                tables = np.concatenate([tables, inputs.group_block_tables])
            return to_device(torch.from_numpy(np.ascontiguousarray(tables)), self.device)
        self.input_batch.apply(inputs.table_diff)
        self.input_batch.commit()
        rows = to_device(torch.from_numpy(inputs.rows), self.device)
        return self.input_batch.gather(rows, inputs.table_width)

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

        Every host -> device copy of the step (block tables, metadata, the sampler's tensors and index rows) is
        issued before the forward and is asynchronous on a card, so between the forward's launch and the
        sampler's one result copy the host never waits for the card.

        Under tensor parallelism every rank runs this with the same inputs (the collectives pair up, the LM
        head's all-gather included); only rank 0 passes `sampling`, the others get None back."""
        self.copy_blocks(inputs.block_copies)
        self.replay_verified(inputs.state_replay)  # before the copies: a fork or snapshot reads the accepted state
        self.copy_states(inputs.state_copies)
        dev = self.device
        tables = self.step_tables(inputs)
        logits_index = to_device(torch.tensor(inputs.logits_rows, dtype=torch.long), dev) \
            if inputs.logits_rows else None
        prepared = None
        if sampling is not None and inputs.logits_rows:
            if self.sampling_state is None:
                # Rows and penalty slots for max_num_seqs: what the memory profile's sampler step held.
                self.sampling_state = SamplingState(self.config.vocab_size, dev, self.max_num_seqs or FIRST_ROWS)
            prepared = self.prepare_sampling(sampling, self.config.vocab_size, dev, self.sampling_state)
        if self.expert_load is not None:
            self.expert_load.begin_step(len(inputs.input_ids))  # a graph's padding rows past it do not count
        graphs = self.graphs if inputs.max_query_len == 1 else self.verify_graphs
        if graphs is not None and inputs.state_read_only is None and graphs.can_run(inputs):
            hidden = graphs.run(inputs, tables)  # copies into its static buffers: no metadata tensors to make
        else:
            meta = AttentionMetadata(
                slot_mapping=to_device(torch.from_numpy(inputs.slot_mapping), dev), block_tables=tables[0],
                seq_lens=to_device(torch.from_numpy(inputs.seq_lens), dev),
                query_start_loc=to_device(torch.from_numpy(inputs.query_start_loc), dev),
                max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len)
            if inputs.group_slot_mappings is not None:
                meta.group_block_tables = tables[1:]
                meta.group_slot_mappings = to_device(torch.from_numpy(inputs.group_slot_mappings), dev)
            if inputs.state_indices is not None:
                meta.state_indices = to_device(torch.from_numpy(inputs.state_indices), dev)
                meta.has_initial_state = to_device(torch.from_numpy(inputs.has_initial_state), dev)
            if inputs.state_read_only is not None:
                meta.state_read_only = to_device(torch.from_numpy(inputs.state_read_only), dev)
                meta.verify_token_rows = to_device(torch.from_numpy(inputs.verify_token_rows), dev)
            if self.piecewise is not None and self.piecewise.can_run(inputs):
                hidden = self.piecewise.run(inputs, meta)  # the pieces, attention eager between them
            else:
                hidden = self.model(to_device(torch.from_numpy(inputs.input_ids), dev),
                                    to_device(torch.from_numpy(inputs.positions), dev), meta)
        if self.expert_load is not None:
            self.expert_load.end_step()  # forwards that are no step (a later capture, warm-up) count nothing
        if self.keep_hidden:
            self.last_hidden = hidden
        prompt_logprobs = None
        if inputs.prompt_logits_rows:
            prompt_logprobs = compute_prompt_logprobs(hidden, inputs.prompt_logits_rows, inputs.prompt_targets,
                                                      inputs.prompt_logprobs_k, self.model.compute_logits,
                                                      reduce=sampling is not None)
        pooled = pool_hidden(hidden, inputs.pool_owners, inputs.pool_spans) \
            if inputs.pool_spans and sampling is not None else None
        if logits_index is None:
            return None if sampling is None else ModelRunnerOutput(prompt_logprobs=prompt_logprobs, pooled=pooled)
        logits = self.model.compute_logits(hidden[logits_index])
        if sampling is None:
            return None
        out = self.sample_prepared(logits, prepared)
        out.prompt_logprobs, out.pooled = prompt_logprobs, pooled
        return out

    @staticmethod
    def prepare_sampling(sampling: SamplingBatch, vocab_size: int, dev: torch.device,
                         state: SamplingState | None = None) -> "PreparedSampling":
        """The sampler's device tensors for a step, made before its forward (asynchronous copies), from
        `state` (rank 0's persistent one; None: a throwaway one for these rows alone)."""
        prepared = PreparedSampling(sampling)
        if sampling.rows:
            state = state or SamplingState(vocab_size, dev, len(sampling.rows))
            prepared.meta = state.metadata(sampling.rows, sampling.bitmask)
            prepared.rows_index = to_device(torch.tensor(sampling.logits_index, dtype=torch.long), dev)
        if sampling.beam_index:
            prepared.beam_index = to_device(torch.tensor(sampling.beam_index, dtype=torch.long), dev)
        if sampling.spec is not None:
            prepared.spec = prepare_verify(sampling.spec, vocab_size, dev)
        return prepared

    @staticmethod
    def sample(logits: torch.Tensor, sampling: SamplingBatch) -> ModelRunnerOutput:
        """Draw the batch's tokens and take beam rows' top log-probs, all on the logits' device."""
        return ModelRunner.sample_prepared(
            logits, ModelRunner.prepare_sampling(sampling, logits.shape[1], logits.device))

    @staticmethod
    def sample_prepared(logits: torch.Tensor, prepared: "PreparedSampling") -> ModelRunnerOutput:
        out, sampling = ModelRunnerOutput(), prepared.batch
        if prepared.meta is not None:
            out.sampled = sample_on_device(logits[prepared.rows_index], prepared.meta,
                                           sampling.generator).to_host()
        if prepared.spec is not None:
            out.spec = verify_drafts(logits, sampling.spec, sampling.generator, prepared.spec)
        if prepared.beam_index is not None:
            values, ids = beam_top_logprobs(logits[prepared.beam_index], sampling.beam_topk)
            # One copy; token ids < 2**53 stay exact in float64.
            out.beam_logprobs, ids = torch.stack([values.double(), ids.double()]).cpu().tolist()
            out.beam_ids = [[int(t) for t in row] for row in ids]
        return out

    def execute(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]],
                sampling: SamplingBatch | None = None,
                state_copies: list[tuple[int, int]] = ()) -> ModelRunnerOutput | None:
        """Run the batch and sample what `sampling` asks for."""
        return self.run(self.prepare(batch, block_copies, state_copies), sampling)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int, kv_dtype: torch.dtype) -> int:
        """One step at the memory peak: prefills of `num_tokens` dummy tokens through the real attention
        path against a temporary KV cache, logits for the batch's sampler rows, then `sample` over them at the
        sampler's widest, with the hidden states and logits still held as `run` holds them. Returns the
        temporary cache's bytes (the real pool replaces them)."""
        batch = profile_batch(num_tokens, max_num_seqs, self.config.max_model_len, self.block_size)
        self.allocate_kv_cache(batch.num_blocks, kv_dtype)
        temporary_kv_bytes = self.kv_cache_bytes()
        try:
            hidden = self.model(torch.from_numpy(batch.input_ids).to(self.device),
                                torch.from_numpy(batch.positions).to(self.device), batch.metadata(self.device))
            num_rows = batch.num_sampler_rows
            rows = torch.arange(len(hidden) - num_rows, len(hidden), device=self.device).clamp_(min=0)
            if self.config.pooler is not None:  # an embedding engine pools: no logits, no sampler
                pool_hidden(hidden, list(range(len(rows))), [(int(r), int(r) + 1) for r in rows])
                del hidden
                return temporary_kv_bytes
            logits = self.model.compute_logits(hidden[rows])
            self.sample(logits, profile_sampling_batch(num_rows, logits.shape[1], self.device))
            del hidden, logits  # only now: a real step holds both until sampling is done
        finally:
            self.release_kv_cache()
        return temporary_kv_bytes

    def profile_memory(self, num_tokens: int, max_num_seqs: int, kv_dtype: torch.dtype) -> list:
        """This card's MemoryProfile after a profiling step (a list: one entry per rank, like the executor)."""
        from engine.worker.kv_cache_sizing import measure_memory
        return [measure_memory(self, num_tokens, max_num_seqs, kv_dtype)]

    def check_health(self) -> None:
        """Nothing to check on one device (the tensor-parallel executor checks its workers)."""

    def shutdown(self) -> None:
        """Nothing to stop on one device: the model and KV cache go with this object."""
