"""Graph dispatch: which path a step's forward takes (a decode or verify CUDA graph, the piecewise graphs, or
eager), and the planning, capture and memory of those graphs.

`plan` decides before the KV pool is sized which graphs this rank will have (so their memory is counted in the
sizing): decode graphs up to max_num_seqs (engine/worker/graphs/decode.py), speculative verify graphs of 1 + k
tokens per row, and piecewise graphs up to the token budget for every other step (engine/worker/graphs/piecewise.py).
`capture` records them once the KV cache exists, then compiles the Triton kernel variants the eager paths will
meet (engine/worker/warm_up.py). Per step, `forward` takes the decode (verify) graphs when they can hold the batch,
else the piecewise pieces when a bucket holds its tokens, else the plain eager forward (on the CPU through
torch.compile when asked: `compile_cpu_forward`), the same step the same way on every tensor-parallel rank (their
collectives must pair up).
"""
from __future__ import annotations

import logging

import torch

from engine.config.model import ModelConfig
from engine.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size
from engine.layers.attention import PagedAttention
from engine.planning.graphs import VERIFY_GRAPH_MAX_BATCH, estimate_graph_bytes, estimate_piecewise_graph_bytes
from engine.worker.graphs.cpu_compile import CompiledForward
from engine.worker.graphs.decode import DecodeGraphs, triton_split_key
from engine.worker.graphs.piecewise import PiecewiseGraphs
from engine.worker.step_buffers import StepBuffers
from engine.worker.step_inputs import StepInputs
from engine.worker.warm_up import triton_tiles_for, warm_up_kernels

logger = logging.getLogger("pagedesk.engine")
WARM_UP_MAX_BATCH = 256  # without graphs, warm up decode batches up to this (covers every split count)


def every_shape(*shape):
    """The finest kernel-configuration key: every shape apart (what tensor parallel keyed graphs on before the
    keys came from `rank_facts`: about 120 decode graphs at the defaults instead of the few the tiles need)."""
    return shape


def rank_facts(device: torch.device) -> list[tuple[int, int]] | None:
    """Every tensor-parallel rank's (SM count, compute capability major), the same list on every rank; None on
    one card. Each rank must capture and warm up the very same shapes, in the same order, or their all-reduces
    would not pair up, so graph keys come from this fixed description of all the cards (a 3090 beside a 4090
    keys on both), never from the rank's own card alone."""
    from kernels.triton_attention import device_facts
    tp = get_tp_size()
    if tp == 1:
        return None
    table = torch.zeros(tp, 2, dtype=torch.int64, device=device)
    table[get_tp_rank()] = torch.tensor(device_facts(device), dtype=torch.int64)
    return [(int(sms), int(major)) for sms, major in all_reduce(table).tolist()]


class GraphDispatcher:
    def __init__(self, model, config: ModelConfig, device: torch.device, dtype: torch.dtype, block_size: int,
                 attention_backend: str, num_kv_groups: int, hybrid: bool, padding_slot_bytes: int = 0) -> None:
        """`hybrid`: the model has linear-attention layers; `padding_slot_bytes`: their one state slot, which the
        decode graphs' padding rows get beside the pool."""
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.block_size, self.attention_backend, self.num_kv_groups = block_size, attention_backend, num_kv_groups
        self.hybrid, self.padding_slot_bytes = hybrid, padding_slot_bytes
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # speculative verify steps: 1 + k tokens per row
        self.piecewise: PiecewiseGraphs | None = None  # prompt and mixed steps
        # The graph backend of every set (engine/worker/graphs/backend.py); None: CUDA graphs. The CPU capture
        # check sets a stand-in (tests/graph_tape.py) and `strict`, so a capture failure raises.
        self.backend, self.strict = None, False
        self.compiled: CompiledForward | None = None  # the CPU forward through torch.compile (cpu_compile.py)
        self.buffers = StepBuffers(device)  # the eager and piecewise paths' inputs, written in place

    def plan(self, max_batch: int, capture: bool = True, piecewise_tokens: int = 0, verify_query_len: int = 0) -> None:
        """Decode steps of up to `max_batch` sequences will replay CUDA graphs (captured after the KV cache
        exists); `capture=False` runs the same padded path eagerly, which is how CPU tests exercise it. With
        `piecewise_tokens`, the other steps of up to that many tokens replay piecewise graphs (on a card).
        With `verify_query_len` (1 + k under speculative decoding), verify steps whose every row has that many
        tokens replay their own graphs, up to VERIFY_GRAPH_MAX_BATCH sequences. A hybrid model's graphs update
        its state pool in place through static slot indices (a padding slot beside the pool for padding rows).
        Whole-forward graphs on a card need the Triton kernels (attention, and a hybrid's DeltaNet layers): the
        torch ones read the batch layout on the host, which a graph cannot replay; the piecewise graphs run
        attention and DeltaNet layers eagerly between their pieces, so they serve every backend."""
        on_card = capture and self.device.type == "cuda"
        if piecewise_tokens and on_card:
            self.piecewise = PiecewiseGraphs(self.model, piecewise_tokens, self.device, self.backend, self.strict,
                                             num_kv_groups=self.num_kv_groups)
        if on_card and self.attention_backend != "triton":
            logger.info("decode CUDA graphs are off with the %s attention backend: its kernels read the batch "
                        "layout on the host, which a graph cannot replay (use the triton backend)",
                        self.attention_backend)
            return
        split_key = None
        if self.attention_backend == "triton":
            split_key = triton_split_key(self.model, self.device, rank_facts(self.device) if on_card else None)
        max_len = self.config.max_model_len
        self.graphs = DecodeGraphs(self.model, max_batch, max_len, self.block_size, self.device, capture, split_key,
                                   self.num_kv_groups, has_state=self.hybrid, backend=self.backend,
                                   strict=self.strict)
        # Hybrid models' verify steps keep a recurrent state per draft position: not captured here (yet); their
        # verify rows run eagerly or through the piecewise pieces (engine/spec_decode/state_rollback.py).
        if verify_query_len > 1 and not self.hybrid:
            self.verify_graphs = DecodeGraphs(self.model, min(max_batch, VERIFY_GRAPH_MAX_BATCH), max_len,
                                              self.block_size, self.device, capture, split_key, self.num_kv_groups,
                                              verify_query_len, backend=self.backend, strict=self.strict)

    def capture(self) -> None:
        """After the KV cache exists: capture the planned graphs, then compile the Triton variants the
        serving path will meet (engine/worker/warm_up.py), so the first requests do not wait for them."""
        sets = [g for g in (self.graphs, self.verify_graphs, self.piecewise) if g is not None]
        if sets:
            planned = self.graph_bytes()  # the estimate the KV pool was sized around
            for graphs in sets:
                graphs.capture()
            captured = self.graph_bytes()
            if captured > planned:
                logger.warning("CUDA graphs took %.0f MiB, %.0f MiB more than the KV sizing planned for; lower "
                               "--gpu-memory-utilization if the card runs out of memory", captured / 2**20,
                               (captured - planned) / 2**20)
        if self.device.type == "cpu":  # numba compiles the decode attention for the caches' arrays now
            for module in self.model.modules():
                if isinstance(module, PagedAttention):
                    module.compile_host_kernel()
        if self.device.type == "cuda" and self.attention_backend == "triton":
            max_batch = self.graphs.max_batch if self.graphs is not None else WARM_UP_MAX_BATCH
            facts = rank_facts(self.device)
            warm_up_kernels(self.model, max_batch, self.config.max_model_len, self.block_size, self.device,
                            None if facts is None else triton_tiles_for(self.model, self.device, facts), True)

    def release(self) -> None:
        """Drop every captured graph and its memory pool (sleep mode: the weights and the KV cache they point at
        leave the card); `capture` records them again over the new tensors."""
        for graphs in (self.graphs, self.verify_graphs):
            if graphs is not None:
                graphs.graphs.clear()
                graphs.outputs.clear()
        if self.piecewise is not None:
            self.piecewise.captured.clear()

    def compile_cpu_forward(self) -> None:
        """The eager path's forward through torch.compile from the next step on (CPU only: a card has graphs)."""
        if self.device.type == "cpu" and self.compiled is None:
            self.compiled = CompiledForward(self.model)

    def graph_bytes(self) -> int:
        """CUDA-graph memory: measured once captured, estimated before (so the KV pool is sized around it)."""
        total, tp = 0, get_tp_size()
        for graphs in (self.graphs, self.verify_graphs):
            if graphs is not None and graphs.capture_graphs:
                total += graphs.pool_bytes if graphs.graphs else estimate_graph_bytes(
                    self.config, graphs.max_batch, self.dtype.itemsize, tp, graphs.query_len)
        if self.graphs is not None and self.graphs.capture_graphs:
            total += self.padding_slot_bytes  # a hybrid model's padding slot (0 for the others)
        if self.piecewise is not None and self.piecewise.enabled:
            total += self.piecewise.pool_bytes if self.piecewise.captured else \
                estimate_piecewise_graph_bytes(self.config, self.piecewise.max_tokens, self.dtype.itemsize, tp)
        return total

    def forward(self, inputs: StepInputs, tables: torch.Tensor, input_ids: torch.Tensor | None = None,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The step's hidden states through the path that takes it; `tables`: its block tables on the device;
        `input_ids`: the input ids already on the device (some written there by the device: async scheduling),
        else they are copied from `inputs`. A hybrid model's verify rows (read-only states) never take the decode
        graphs; a step with image embeddings or mRoPE's three position streams runs eagerly (the graphs' buffers
        hold token ids and one position row)."""
        if mm_embeds is not None or inputs.positions.ndim > 1:
            ids, positions, meta = self.buffers.load(inputs, tables)
            return self.model(ids if input_ids is None else input_ids, positions, meta, mm_embeds)
        graphs = self.graphs if inputs.max_query_len == 1 else self.verify_graphs
        fed = () if input_ids is None else (input_ids,)  # only when the device wrote ids: `run` wrappers take two
        if graphs is not None and inputs.state_read_only is None and graphs.can_run(inputs):
            return graphs.run(inputs, tables, *fed)  # copies into its static buffers: no metadata tensors to make
        ids, positions, meta = self.buffers.load(inputs, tables)
        if self.piecewise is not None and self.piecewise.can_run(inputs):
            return self.piecewise.run(inputs, meta, *fed)  # the pieces, attention eager between them
        return (self.compiled or self.model)(ids if input_ids is None else input_ids, positions, meta)
