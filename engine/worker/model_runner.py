"""ModelRunner: builds the model (this rank's shard of it) on one device, loads it, and runs one batch at a time.

It is the orchestrator of four parts, each in its own module: input preparation (engine/worker/input_prep.py:
the scheduled batch as flat numpy `StepInputs`, which rank 0 ships to tensor-parallel workers, and their device
tensors), the KV and state pools (engine/worker/kv_pools.py), graph dispatch (engine/worker/graphs/dispatch.py:
decode graph, piecewise or eager, and the graphs' planning and capture) and device sampling
(engine/worker/sampling.py), with the prefix cache's CPU-RAM tier beside the pools (engine/worker/kv_offload.py,
when --kv-offloading-size asks for one). `run` issues the step's tier copies first, applies the step's pool edits, issues every host -> device copy of the step
(asynchronous on a card, the sampler's tensors included) before the forward, runs the model once over all of
it through the path dispatch picks, then computes logits only where they are needed and samples them on the
device (as nano-vllm does), returning token ids and the logprobs asked for. `launch` is the same step for async
scheduling: the sampled ids' copy to the host is only started, they stay on the device, and the next step's
decodes read their input tokens from them there. `profile_run` is the KV sizing's peak step. It never talks to
other processes itself.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.config.gguf_file import is_gguf
from engine.config.model import ModelConfig
from engine.core.scheduler import ScheduledSeq
from engine.distributed.parallel_state import get_tp_rank
from engine.kv.kv_cache_interface import model_kv_layout
from engine.layers.fused_moe.expert_load import ExpertLoad
from engine.layers.linear import keep_dequantized
from engine.models.registry import model_class
from engine.platform.devices import indexed_device
from engine.platform.host_copies import to_device
from engine.sample.metadata import SamplingBatch
from engine.sample.pooling import drop_lm_head, embedding_weights, pool_hidden
from engine.multimodal.encoder_cache import EncoderWork
from engine.multimodal.inputs import ProfileImage
from engine.multimodal.processor import profile_pixels
from engine.worker.encoder_runner import EncoderRunner
from engine.worker.gpu_baseline import free_bytes_at_start
from engine.worker.graphs.dispatch import GraphDispatcher
from engine.worker.input_prep import InputPreparer, logits_index
from engine.kv.offload.transfers import KVTransfers
from engine.worker.kv_cache_sizing import measure_memory
from engine.worker.kv_offload import HostKVTier
from engine.worker.sleep import SleepingWeights
from engine.worker.kv_pools import KVPools
from engine.worker.gguf_loader import iterate_gguf_weights
from engine.worker.loader import iterate_weights
from engine.worker.profiling import profile_batch, profile_sampling_batch, profile_verify_batch
from engine.worker.sampling import DeviceSampler, sample
from engine.worker.step_inputs import ModelRunnerOutput, StepInputs
from kernels import cpu_host_ops, cpu_linear, native_kernels


def draft_token_rows(inputs: StepInputs, spec) -> np.ndarray:
    """The token row of every draft token of a verify step, sequence by sequence: a sequence's verify rows are
    its last token then its drafts, so draft i sits at the token row of the sequence's verify row i."""
    rows, first = [], 0
    for drafts in spec.draft_token_ids:
        rows += [inputs.logits_rows[spec.logits_index[first + i]] for i in range(1, len(drafts) + 1)]
        first += len(drafts) + 1
    return np.asarray(rows, dtype=np.int64)


def rejected_drafts(spec, verified) -> np.ndarray:
    """1 for each draft (in draft_token_rows' order) the rejection sampler turned down, 0 for the accepted."""
    return np.asarray([int(i >= accepted) for drafts, accepted in zip(spec.draft_token_ids, verified.num_accepted)
                       for i in range(len(drafts))], dtype=np.int64)


class _Kept:
    """A runner attribute that one of its parts keeps (`graphs` on the dispatcher, `kv_cache` on the pools):
    read, and set, through the runner, so tools and tests can look at a part or swap graphs in."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, runner, owner=None):
        return self if runner is None else getattr(getattr(runner, self.part), self.name)

    def __set__(self, runner, value) -> None:
        setattr(getattr(runner, self.part), self.name, value)


class ModelRunner:
    graphs = _Kept("dispatch")
    verify_graphs = _Kept("dispatch")
    piecewise = _Kept("dispatch")
    kv_cache = _Kept("pools")
    state_cache = _Kept("pools")
    verify_states = _Kept("input_prep")
    sampling_state = _Kept("sampler")

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
        self.model_path = model_path
        if model_config.pooler is not None:  # an embedding engine: no LM head (engine/sample/pooling.py)
            drop_lm_head(self.model)
        self.model.load_weights(self.checkpoint_weights())
        self.model.eval()
        # Routed tokens per (MoE layer, expert), on the device; every rank routes alike, rank 0 counts.
        self.expert_load = ExpertLoad.bind(self.model, device) if get_tp_rank() == 0 else None
        self.kv_layout = layout = model_kv_layout(model_config, block_size)  # the engine's KVCacheManager reads it
        # The last step's hidden states (the model's output, after its final norm), kept for an MTP head
        # (engine/spec_decode/proposers/mtp.py) until it has read them; off otherwise.
        self.keep_hidden, self.last_hidden = False, None
        self.pools = KVPools(self.model, layout, device, dtype, block_size)
        vision = model_config.vision
        self.input_prep = InputPreparer(layout, block_size, model_config.max_model_len, device,
                                        pooling=model_config.pooler is not None,
                                        mrope=vision is not None and vision.mrope_section is not None,
                                        bidirectional_images=vision is not None and vision.bidirectional)
        self.encoder = EncoderRunner(self.model, device, dtype) if vision is not None else None
        self.dispatch = GraphDispatcher(self.model, model_config, device, dtype, block_size, attention_backend,
                                        len(layout.groups), hybrid=layout.state is not None,
                                        padding_slot_bytes=self.pools.state_slot_bytes())
        self.sampler = DeviceSampler(self.model, model_config.vocab_size, device)
        self.offload: HostKVTier | None = None  # the prefix cache's CPU-RAM tier, once allocated
        self.kv_allocation: tuple | None = None  # allocate_kv_cache's arguments, to allocate again after sleep
        self.sleeping: SleepingWeights | None = None
        self.step_timer = None  # the engine's StepTimer (engine/core/step_timer.py): `run` laps "prepare"
        # Async scheduling: the last launched step's sampled token ids, still on the device, which the next step's
        # decodes read as their input (their rows: `input_prep.last_sample_rows`).
        self.last_sampled: torch.Tensor | None = None

    def checkpoint_weights(self):
        """The checkpoint's (name, tensor) pairs this model loads (an embedding engine's without the LM head)."""
        path = self.model_path
        weights = iterate_gguf_weights(path, self.model) if is_gguf(path) else iterate_weights(path, device="cpu")
        return weights if self.config.pooler is None else embedding_weights(weights, self.model)

    # ---- sizes -------------------------------------------------------------------------------------------

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_cache_bytes(self) -> int:
        """The paged KV cache and a hybrid model's state pool."""
        return self.pools.kv_cache_bytes()

    def graph_bytes(self) -> int:
        """CUDA-graph memory: measured once captured, estimated before (so the KV pool is sized around it)."""
        return self.dispatch.graph_bytes()

    def expert_load_totals(self) -> dict | None:
        """Routed token assignments per MoE layer and expert since start (ExpertLoad.totals; one small device ->
        host copy, between steps), None for a dense model."""
        return None if self.expert_load is None else self.expert_load.totals()

    # ---- start-up, in the engine's order ---------------------------------------------------------------------

    def reserve_input_rows(self, max_num_seqs: int) -> None:
        """The input batch's rows for every sequence the scheduler may run, before the KV pool is sized."""
        self.input_prep.input_batch.reserve(max_num_seqs)
        self.sampler.max_rows = max_num_seqs

    def reserve_draft_rows(self, max_drafts: int) -> None:
        """Speculative decoding: the expert-load counter's room for a step's `max_drafts` draft rows (max_num_seqs
        × k), so rejected drafts can be taken back out of the counts (ExpertLoad.drop_rejected)."""
        if self.expert_load is not None:
            self.expert_load.reserve_drafts(max_drafts)

    def reserve_verify_tokens(self, num_tokens: int) -> None:
        """A hybrid model under speculative decoding: every linear-attention layer's verify scratch for
        `num_tokens` verify tokens a step (max_num_seqs * (1 + k)), before the KV pool is sized."""
        if self.kv_layout.state is None or num_tokens <= 0:
            return
        self.pools.reserve_verify_tokens(num_tokens)
        self.verify_states.max_rows = num_tokens

    def plan_decode_graphs(self, max_batch: int, capture: bool = True, piecewise_tokens: int = 0,
                           verify_query_len: int = 0) -> None:
        """The CUDA graphs this rank will capture (GraphDispatcher.plan), before the KV pool is sized."""
        self.dispatch.plan(max_batch, capture, piecewise_tokens, verify_query_len)

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype, num_state_slots: int = 0) -> None:
        """The paged KV cache of `num_blocks` blocks (KVPools). A hybrid model's linear-attention layers also
        get their state pool: `num_state_slots` (max_num_seqs) slots."""
        if self.kv_layout.state is not None and num_state_slots:  # not the profiling run's temporary cache
            self.allocate_state_cache(num_state_slots)
        self.pools.allocate_kv_cache(num_blocks, kv_dtype)
        self.kv_allocation = (num_blocks, kv_dtype, num_state_slots)

    def allocate_state_cache(self, num_slots: int) -> None:
        """The state pool; with decode graphs one more slot, `num_slots`, is the graphs' padding slot: padding
        rows update it, no sequence ever holds it."""
        self.pools.allocate_state_cache(num_slots, padding_slot=self.graphs is not None)
        if self.graphs is not None:
            self.graphs.bind_state_padding(num_slots)

    def allocate_kv_offload(self, num_blocks: int, num_state_slots: int = 0) -> int:
        """The CPU-RAM tier's host copies of `num_blocks` block ids (and a hybrid model's `num_state_slots` state
        snapshots), after the KV cache; returns their bytes on this rank."""
        self.offload = HostKVTier(self.pools, num_blocks, num_state_slots, self.device)
        return self.offload.host_bytes()

    def capture_decode_graphs(self) -> None:
        """After the KV cache exists: capture the planned graphs and compile the Triton variants
        (GraphDispatcher.capture)."""
        self.dispatch.capture()

    def keep_dequantized(self, budget_bytes: float) -> int:
        """--cpu-dequant-cache: float copies of the quantized linears' weights within the budget; bytes held."""
        return keep_dequantized(self.model, budget_bytes, self.dtype)

    def set_cpu_linear(self, name: str) -> None:
        """--cpu-linear: how this process's float32 CPU linears run (kernels/cpu_linear.py), whether a decode
        batch's norms and activations take their fused native calls (kernels/cpu_host_ops.py; not under "torch"),
        and whether its float32 attention takes the native kernel (kernels/decode_attention.c; under "rows");
        compiled now."""
        cpu_linear.set_backend(name)
        cpu_linear.warm_up()
        cpu_host_ops.set_enabled(name != "torch")
        cpu_host_ops.warm_up()
        native_kernels.set_attention(name == "rows")  # the native decode attention shares the linears' library

    def compile_cpu_forward(self) -> None:
        """On the CPU: the eager forward through torch.compile (GraphDispatcher.compile_cpu_forward)."""
        self.dispatch.compile_cpu_forward()

    # ---- steps -------------------------------------------------------------------------------------------

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.pools.copy_blocks(copies)

    def transfer_kv(self, transfers: KVTransfers) -> None:
        """Issue a batch of tier copies without a forward (a step that runs nothing, or an idle engine's stores)."""
        self.offload.submit(transfers)

    def kv_transfers_done(self) -> int:
        """The last tier copy batch this rank has finished (0 without a tier)."""
        return 0 if self.offload is None else self.offload.completed()

    def wait_kv_transfers(self, batch: int, timeout: float) -> bool:
        """Block until the tier copy batch `batch` has run here, or `timeout` seconds passed."""
        return self.offload is None or self.offload.wait(batch, timeout)

    def prepare(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]] = (),
                state_copies: list[tuple[int, int]] = (), encoder: EncoderWork | None = None) -> StepInputs:
        """Flat, device-free inputs for the whole batch (InputPreparer.prepare; rank 0)."""
        return self.input_prep.prepare(batch, block_copies, state_copies, encoder)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, sampling: SamplingBatch | None = None,
            defer: bool = False) -> ModelRunnerOutput | None:
        """One forward over prepared inputs, then sampling on the device; the small results on the host.

        Every host -> device copy of the step (block tables, metadata, the sampler's tensors and index rows) is
        issued before the forward and is asynchronous on a card, so between the forward's launch and the
        sampler's one result copy the host never waits for the card.

        Under tensor parallelism every rank runs this with the same inputs (the collectives pair up, the LM
        head's all-gather included); only rank 0 passes `sampling`, the others get None back.

        With `defer` (a launched step) the sampled tokens' copy to the host is only started: the output's
        `result()` waits for it, and the tokens stay on the device for the next step's inputs."""
        if inputs.kv_transfers is not None:  # first: stores read blocks this step may overwrite (then it waits)
            self.offload.submit(inputs.kv_transfers)
        self.pools.copy_blocks(inputs.block_copies)
        # Before the state copies: a fork or snapshot reads the accepted state.
        self.pools.replay_verified(inputs.state_replay)
        self.pools.copy_states(inputs.state_copies)
        tables = self.input_prep.step_tables(inputs)
        rows = logits_index(inputs, self.device)
        prepared = self.sampler.prepare(inputs, sampling)
        if self.step_timer is not None:  # the host's part of the step ends here: the rest is the device's
            self.step_timer.lap("prepare")
        drafts = None
        if self.expert_load is not None:
            if sampling is not None and sampling.spec is not None and self.expert_load.draft_rows is not None:
                drafts = to_device(torch.from_numpy(draft_token_rows(inputs, sampling.spec)), self.device)
            self.expert_load.begin_step(len(inputs.input_ids), drafts)  # a graph's padding rows do not count
        mm_embeds = self.encoder.run(inputs) if self.encoder is not None else None
        hidden = self.dispatch.forward(inputs, tables, self._fed_input_ids(inputs), mm_embeds)
        if self.expert_load is not None:
            self.expert_load.end_step()  # forwards that are no step (a later capture, warm-up) count nothing
        if self.keep_hidden:
            self.last_hidden = hidden
        out = self.sampler.finish(hidden, inputs, rows, prepared, sampling, defer)
        if drafts is not None:  # the drafts the rejection sampler turned down were routed, but are no tokens
            self.expert_load.drop_rejected(to_device(torch.from_numpy(rejected_drafts(sampling.spec, out.spec)),
                                                     self.device))
        return out

    def _fed_input_ids(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's input ids on the device with the tokens the last step sampled written in on the device
        (async scheduling: the host never saw them); None when every input id is on the host."""
        if inputs.pending_rows is None:
            return None
        rows, sources = inputs.pending_rows, inputs.pending_sources
        if len(rows) == len(inputs.input_ids) == len(self.last_sampled) and rows.tobytes() == sources.tobytes():
            # Every row's input is the last step's sample of the same row (decode after decode, the same batch):
            # the samples are the ids, no tensor to make (the model only reads them).
            return self.last_sampled
        ids = to_device(torch.from_numpy(inputs.input_ids.copy()), self.device)  # a CPU "copy" would share it
        index = to_device(torch.from_numpy(np.concatenate([inputs.pending_rows, inputs.pending_sources])),
                          self.device)
        n = len(inputs.pending_rows)
        ids.index_copy_(0, index.narrow(0, 0, n), self.last_sampled.index_select(0, index.narrow(0, n, n)))
        return ids

    def launch(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]],
               sampling: SamplingBatch | None = None, state_copies: list[tuple[int, int]] = (),
               encoder: EncoderWork | None = None) -> ModelRunnerOutput | None:
        """`execute` for async scheduling: the step is queued on the device and its output comes back at once;
        its `result()` waits for the sampled tokens, which also stay on the device for the next step."""
        out = self.run(self.prepare(batch, block_copies, state_copies, encoder), sampling, defer=True)
        pending = out.pending if out is not None else None
        self.last_sampled = pending.tokens.token_ids if pending is not None else None
        self.input_prep.last_sample_rows = {row.key: i for i, row in enumerate(sampling.rows)} \
            if pending is not None else {}
        return out

    def execute(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]],
                sampling: SamplingBatch | None = None, state_copies: list[tuple[int, int]] = (),
                kv_transfers: KVTransfers | None = None,
                encoder: EncoderWork | None = None) -> ModelRunnerOutput | None:
        """Run the batch (its images encoded first) and sample what `sampling` asks for."""
        inputs = self.prepare(batch, block_copies, state_copies, encoder)
        inputs.kv_transfers = kv_transfers
        return self.run(inputs, sampling)

    # ---- sleep mode ---------------------------------------------------------------------------------------------

    def sleep(self, level: int) -> dict[str, int]:
        """Give this rank's device memory back (engine/worker/sleep.py): level 1 keeps the weights in host RAM,
        level 2 drops them; both drop the KV cache, the state pool and the CUDA graphs (the CPU-RAM tier's host
        copies stay). Returns the bytes freed on the device, by kind."""
        if self.offload is not None:
            self.offload.drain()  # no copy may still read or write the pool
        freed = {"kv_cache_bytes": self.kv_cache_bytes(), "weights_bytes": 0}
        self.dispatch.release()
        self.pools.release_kv_cache()
        self.pools.release_state_cache()
        self.sleeping = SleepingWeights(self.model, level, self.device)
        if self.device.type == "cuda" or level == 2:
            freed["weights_bytes"] = self.sleeping.device_bytes
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return freed

    def wake_up(self) -> None:
        """Weights back on the device (reloaded from the checkpoint after level 2), the KV cache and state pool
        allocated again, empty, and the CUDA graphs captured again over them."""
        self.sleeping.wake(lambda: self.model.load_weights(self.checkpoint_weights()))
        self.sleeping = None
        self.allocate_kv_cache(*self.kv_allocation)
        self.dispatch.capture()

    # ---- the KV sizing's profile -------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int, kv_dtype: torch.dtype,
                    num_speculative_tokens: int = 0, image: ProfileImage | None = None) -> int:
        """One step at the memory peak: prefills of `num_tokens` dummy tokens through the real attention
        path against a temporary KV cache, logits for the batch's sampler rows, then `sample` over them at the
        sampler's widest (with `num_speculative_tokens` k: a verify step, 1 + k rows per sequence through the
        rejection sampler), with the hidden states and logits still held as `run` holds them. Returns the
        temporary cache's bytes (the real pool replaces them). `image`: a VL model's largest image (its size:
        this rank makes the processor's tensors), encoded first as a step encodes before its forward; its
        embeddings go to the encoder cache, which the sizing counts by rule, so they are dropped here."""
        batch = profile_batch(num_tokens, max_num_seqs, self.config.max_model_len, self.block_size,
                              num_speculative_tokens)
        self.pools.allocate_pages(batch.num_blocks, kv_dtype)  # no pool behind it: no null page either
        temporary_kv_bytes = self.pools.kv_cache_bytes()
        try:
            if image is not None:  # the tower's peak; its output is the encoder cache's (counted by rule)
                self.encoder.encode(profile_pixels(image))
            hidden = self.model(torch.from_numpy(batch.input_ids).to(self.device),
                                torch.from_numpy(batch.positions).to(self.device), batch.metadata(self.device))
            num_rows = batch.num_sampler_rows
            rows = torch.arange(len(hidden) - num_rows, len(hidden), device=self.device).clamp_(min=0)
            if self.config.pooler is not None:  # an embedding engine pools: no logits, no sampler
                pool_hidden(hidden, list(range(len(rows))), [(int(r), int(r) + 1) for r in rows])
                del hidden
                return temporary_kv_bytes
            logits = self.model.compute_logits(hidden[rows])
            vocab = logits.shape[1]
            sample(logits, profile_verify_batch(num_rows, num_speculative_tokens, vocab, self.device)
                   if num_speculative_tokens else profile_sampling_batch(num_rows, vocab, self.device))
            del hidden, logits  # only now: a real step holds both until sampling is done
        finally:
            self.pools.release_kv_cache()
        return temporary_kv_bytes

    def profile_memory(self, num_tokens: int, max_num_seqs: int, kv_dtype: torch.dtype,
                       num_speculative_tokens: int = 0, image: ProfileImage | None = None) -> list:
        """This card's MemoryProfile after a profiling step (a list: one entry per rank, like the executor)."""
        return [measure_memory(self, num_tokens, max_num_seqs, kv_dtype, num_speculative_tokens, image)]

    def check_health(self) -> None:
        """Nothing to check on one device (the tensor-parallel executor checks its workers)."""

    def shutdown(self) -> None:
        """Only the tier's copy queue to stop on one device: the model and KV cache go with this object."""
        if self.offload is not None:
            self.offload.close()
