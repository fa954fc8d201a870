"""Capacity arithmetic: KV bytes per token, and how many tokens fit the KV budget (weights per card, and what a
draft model or MTP head adds, are engine/planning/model_footprint.py's).

Torch-free so the GUI's capacity planner and the engine's KV sizing run the SAME functions. On CUDA the
engine measures every card (`MemoryProfile`: free memory at start, what it holds after loading, the peak
of a profiling forward with attention and the sampler, memory outside torch's allocator, CUDA graphs)
and `plan_from_profile` turns it into a plan; the planner builds the same `MemoryProfile` from estimates
(`estimate_profile`) and calls the same function. The formula is vLLM v1's / nano-vllm's:

    KV bytes = total × gpu_memory_utilization − (what other programs held at start) − (this process's peak)
    blocks   = KV bytes // (KV bytes per token per card × block_size)

On CPU the KV budget is explicit (--kv-cache-memory) and `plan_cpu` caps the pool at max_num_seqs full
sequences, for the engine and the planner alike. On CUDA an explicit --kv-cache-memory is an absolute budget
(vLLM's --kv-cache-memory-bytes, `plan_from_budget`): what else holds memory on the card is not subtracted, so
the router can place several engines on one card, each sized by its own budget instead of seeing its
siblings as "other programs".

Models with sliding-window layers (engine/kv/kv_cache_interface.py) count a block id across every cache slot,
and a sequence's need per group: a full-attention group grows with the context, a window group stops at the
window plus one step's chunk. So "tokens that fit" is the longest single context the pool holds, and
"full-length sequences" divides the pool by one sequence's peak over all groups. `window_freeing=False`
plans the same model as if no block were ever freed (every layer full attention), for comparison.

Speculative decoding with a draft model or an MTP head adds its weights (on rank 0's card: it runs there whole)
and a page of its KV at every block id (its cache is addressed by the target's block ids): the budget is
shared in proportion, `blocks_with_draft`, for the engine and the planner alike.

Hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet layers beside full attention) hold a fixed-size state per
sequence, not per token: the state pool (one slot per seat, max_num_seqs of them; engine/kv/state_pool.py) comes
out of the KV budget first (`state_bytes`), and only the full-attention layers take bytes per token.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.kv.kv_cache_interface import KVCacheLayout, model_kv_layout
from engine.config.model import DTYPE_BYTES, ModelConfig
from engine.planning.model_footprint import (QUANT_BITS, draft_footprint, mtp_footprint, rope_table_bytes,
                                     weights_bytes_per_card)

GIB = 1024 ** 3
MIB = 1024 ** 2
SAMPLER_BYTES_PER_LOGIT = 36
GRAPH_OVERHEAD_BYTES = 2 * MIB  # per captured graph: kernel parameters and bookkeeping (an estimate)
SPLIT_CONTEXT_LENGTHS = (512, 1024, 2048, 4096, 8192)  # where the decode kernel's split count can change


def batch_size_ladder(max_batch: int) -> list[int]:
    """Decode batch sizes captured as CUDA graphs: 1, 2, 4, 8, then every 16 up to max_batch (vLLM's spacing)."""
    ladder = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 16, 16))
    return sorted({min(b, max_batch) for b in ladder})


def context_length_ladder(max_model_len: int) -> list[int]:
    """Context lengths the captured decode graphs are specialised for: the attention kernel picks its KV
    split count from the block-table width, so a graph captured only at max_model_len would split short
    contexts as if they were long."""
    return [c for c in SPLIT_CONTEXT_LENGTHS if c < max_model_len] + [max_model_len]


def resolve_dtype(requested: str | None, model_dtype: str, on_gpu: bool) -> str:
    """What the engine will run in: auto is float32 on CPU, the model's 16-bit dtype (else bf16) on CUDA."""
    if requested not in ("auto", None):
        return {"half": "float16", "float": "float32"}.get(requested, requested)
    if not on_gpu:
        return "float32"
    return model_dtype if model_dtype in ("float16", "bfloat16") else "bfloat16"


def format_bytes(n: int) -> str:
    """GiB with two decimals from 1 GiB up, MiB below: tiny test models must not read as 0.00 GiB."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB // 10:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype_bytes: int, tp: int = 1, block_size: int = 16,
                       window_freeing: bool = True) -> int:
    """K and V bytes of one token position of a block id on one card, over every cache slot (one per layer
    without sliding windows): KV heads are split across ranks, replicated below one each."""
    layout = model_kv_layout(cfg, block_size, kv_dtype_bytes, tp, window_freeing)
    return layout.bytes_per_block // block_size


def blocks_with_draft(num_blocks: int, target_bytes_per_block: int, draft_bytes_per_block: int) -> int:
    """Blocks when every block id also holds a page of a speculative proposer's KV (a draft model's or an MTP
    head's): the pool sized for the target's pages alone, shared between both caches in proportion to their
    bytes per block."""
    if not draft_bytes_per_block:
        return num_blocks
    return num_blocks * target_bytes_per_block // (target_bytes_per_block + draft_bytes_per_block)


def sampler_bytes(num_seqs: int, vocab_size: int) -> int:
    """Peak of sampling `num_seqs` rows: float32 logits and the sampler's full-vocabulary temporaries."""
    return num_seqs * vocab_size * SAMPLER_BYTES_PER_LOGIT


def estimate_activation_bytes(cfg: ModelConfig, num_tokens: int, dtype_bytes: int, tp: int = 1,
                              max_num_seqs: int = 256) -> int:
    """Peak transient memory of one step over `num_tokens` tokens (the planner's stand-in for profiling):
    the forward's activations plus sampling min(num_tokens, max_num_seqs) rows over the whole vocabulary."""
    per_token = (4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
                 + 3 * cfg.intermediate_size // tp) * dtype_bytes
    return num_tokens * per_token + sampler_bytes(min(num_tokens, max_num_seqs), cfg.vocab_size)


# Speculative verify graphs (1 + k tokens per row) are captured up to this batch: speculation pays at small
# batches (BENCHMARKS.md), and each verify batch holds 1 + k times the tokens of a decode batch.
VERIFY_GRAPH_MAX_BATCH = 64


def estimate_graph_bytes(cfg: ModelConfig, max_num_seqs: int, dtype_bytes: int, tp: int = 1,
                         query_len: int = 1) -> int:
    """CUDA-graph memory before capture: the largest decode batch's activations (the graphs share one pool)
    plus bookkeeping per graph, counting every (batch size, context length) pair that may be captured;
    `query_len` > 1: speculative verify graphs, each row 1 + k tokens."""
    num_graphs = len(batch_size_ladder(max_num_seqs)) * len(context_length_ladder(cfg.max_model_len))
    return estimate_activation_bytes(cfg, max(batch_size_ladder(max_num_seqs)) * query_len, dtype_bytes, tp, 0) + \
        GRAPH_OVERHEAD_BYTES * num_graphs


PIECE_OVERHEAD_BYTES = 64 * 1024  # per captured piece: a few layers' kernel nodes (an estimate)
PIECEWISE_MIN_BUCKET = 16  # engine/worker/graphs/piecewise.py's spacing of token buckets, mirrored (torch-free here)


def piecewise_bucket_count(max_tokens: int, min_bucket: int = PIECEWISE_MIN_BUCKET) -> int:
    """How many token buckets engine/piecewise_graphs.token_buckets captures (the same spacing, counted)."""
    count, size = 0, min_bucket
    while size < max_tokens:
        count += 1
        size += min_bucket if size < 4 * min_bucket else (1 << (size.bit_length() - 1)) // 4
    return count + 1


def estimate_piecewise_graph_bytes(cfg: ModelConfig, max_tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """Piecewise graphs' memory before capture: one forward's activations at the largest bucket (every bucket's
    pieces share one pool, captured largest first) plus bookkeeping per piece (one per layer and one more, per
    bucket). The eager points' outputs are allocated inside the pieces, so they are part of the activations."""
    pieces = piecewise_bucket_count(max_tokens) * (cfg.num_layers + 1)
    return estimate_activation_bytes(cfg, max_tokens, dtype_bytes, tp, 0) + PIECE_OVERHEAD_BYTES * pieces


def estimate_cuda_graph_bytes(cfg: ModelConfig, max_num_seqs: int, max_num_batched_tokens: int, dtype_bytes: int,
                              tp: int = 1, cuda_graph_mode: str = "full_and_piecewise") -> int:
    """Every CUDA graph the engine captures for --cuda-graph-mode, before capture (what the model runner's
    `graph_bytes` estimates): the decode graphs, with "full_and_piecewise" the piecewise pieces up to the step
    budget too, and for a hybrid model the decode graphs' padding state slot beside the pool."""
    if cuda_graph_mode not in ("full_and_piecewise", "full_decode_only"):
        raise ValueError(f"cuda_graph_mode {cuda_graph_mode!r}: choose full_and_piecewise or full_decode_only")
    total = estimate_graph_bytes(cfg, max_num_seqs, dtype_bytes, tp)
    if cuda_graph_mode == "full_and_piecewise":
        total += estimate_piecewise_graph_bytes(cfg, max_num_batched_tokens, dtype_bytes, tp)
    return total + model_kv_layout(cfg, 16, dtype_bytes, tp, act_dtype_bytes=dtype_bytes).state_bytes_per_seq


def estimate_verify_graph_bytes(cfg: ModelConfig, max_num_seqs: int, dtype_bytes: int, tp: int,
                                num_speculative_tokens: int) -> int:
    """Speculative verify steps' graphs, (batch, 1 + k) up to VERIFY_GRAPH_MAX_BATCH rows; none without
    speculation, and none for hybrid models (which verify through the piecewise graphs)."""
    if not num_speculative_tokens or getattr(cfg, "linear_attention", None) is not None:
        return 0
    return estimate_graph_bytes(cfg, min(max_num_seqs, VERIFY_GRAPH_MAX_BATCH), dtype_bytes, tp,
                                1 + num_speculative_tokens)


@dataclass
class CapacityPlan:
    card_bytes: int  # total memory of the card this plan is for (the KV budget on CPU)
    usable_bytes: int  # total × gpu_memory_utilization − what other programs held at start
    weights_bytes: int  # per card: what the process holds after loading (parameters, RoPE table)
    activation_bytes: int  # per card: peak of one step at max_num_batched_tokens, sampler included
    kv_bytes_per_token: int  # per card
    kv_budget_bytes: int  # per card
    block_size: int
    max_model_len: int
    tensor_parallel_size: int
    overhead_bytes: int = 0  # CUDA graphs and memory outside torch's allocator (CUDA context, NCCL buffers)
    other_programs_bytes: int = 0  # held by the desktop and other processes when the engine started
    card: str = ""  # which card this plan is for, e.g. "cuda:1 (NVIDIA GeForce RTX 3090)", or "CPU"
    gpu_memory_utilization: float = 0.0  # 0 on CPU, where the budget is --kv-cache-memory
    max_blocks: int | None = None  # CPU: more than max_num_seqs full sequences could use is memory for nothing
    layout: KVCacheLayout | None = None  # KV cache groups; None or one full group: tokens are blocks × block_size
    max_num_batched_tokens: int = 0  # a window group's need is its window plus one step's chunk
    state_bytes: int = 0  # per card: a hybrid model's state pool (max_num_seqs slots), already out of the budget
    # Speculative decoding's draft model (rank 0's card): its weights (part of weights_bytes) and its KV page
    # at every block id, which shares the budget with the target's (`blocks_with_draft`).
    draft_weights_bytes: int = 0
    draft_kv_bytes_per_block: int = 0

    @property
    def num_blocks(self) -> int:
        blocks = max(0, self.kv_budget_bytes // (self.kv_bytes_per_token * self.block_size))
        blocks = blocks if self.max_blocks is None else min(blocks, self.max_blocks)
        return blocks_with_draft(blocks, self.kv_bytes_per_token * self.block_size, self.draft_kv_bytes_per_block)

    @property
    def has_windows(self) -> bool:
        return self.layout is not None and self.layout.has_sliding_window

    @property
    def num_tokens(self) -> int:
        """The longest single context the pool holds (window groups hold only their window)."""
        if not self.has_windows:
            return self.num_blocks * self.block_size
        return self.layout.longest_context(self.num_blocks, self.max_num_batched_tokens, self.max_model_len)

    @property
    def num_full_seqs(self) -> int:
        if not self.has_windows:
            return self.num_tokens // self.max_model_len
        return self.num_blocks // self.layout.blocks_per_seq(self.max_model_len, self.max_num_batched_tokens)

    @property
    def fits(self) -> bool:
        return self.num_full_seqs >= 1

    def summary(self) -> str:
        groups = ""
        if self.has_windows:
            kinds = [g.spec.sliding_window or "full" for g in self.layout.groups]
            groups = f" · {len(kinds)} KV groups ({', '.join(f'window {k}' if k != 'full' else k for k in kinds)})"
        if self.state_bytes:
            groups += f" · linear-attention states {format_bytes(self.state_bytes)}/card"
        if self.draft_kv_bytes_per_block:
            groups += (f" · draft model {format_bytes(self.draft_weights_bytes)} + KV "
                       f"{self.draft_kv_bytes_per_block / self.block_size / 1024:.1f} KiB/token")
        return (f"weights {format_bytes(self.weights_bytes)}/card · KV {self.kv_bytes_per_token / 1024:.1f} KiB/token"
                f"{groups} · {self.num_tokens:,} tokens fit · {self.num_full_seqs} × {self.max_model_len:,}-token "
                "sequences")

    def explain_misfit(self) -> str:
        if not self.gpu_memory_utilization:
            return (f"--kv-cache-memory {self.kv_budget_bytes / GIB:.3f} GiB holds {self.num_tokens:,} tokens at "
                    f"{self.kv_bytes_per_token:,} bytes/token, less than one {self.max_model_len:,}-token sequence "
                    "(max_model_len); raise --kv-cache-memory or lower --max-model-len")
        where = f" on {self.card}" if self.card else ""
        usable = f"{self.card_bytes / GIB:.2f} GiB × gpu_memory_utilization {self.gpu_memory_utilization:.2f}"
        if self.other_programs_bytes:
            usable += f" − {self.other_programs_bytes / GIB:.2f} GiB other programs hold"
        overhead = f" − CUDA graphs/context/NCCL {self.overhead_bytes / GIB:.2f} GiB" if self.overhead_bytes else ""
        if self.weights_bytes >= self.usable_bytes:
            levers = ("The weights alone need more than the usable memory: raise --tensor-parallel-size (more cards) "
                      "or pick a smaller or 4-bit model")
        elif self.num_tokens:
            levers = (f"Lower --max-model-len to {self.num_tokens:,} or less, raise --gpu-memory-utilization, use "
                      "--kv-cache-dtype fp8, or raise --tensor-parallel-size")
        else:
            levers = ("Lower --max-num-batched-tokens or --max-num-seqs (activations), raise "
                      "--gpu-memory-utilization, or raise --tensor-parallel-size")
        if self.state_bytes:  # a hybrid model's state pool grows with the seats, not the context
            overhead += f" − linear-attention states {self.state_bytes / GIB:.2f} GiB"
            levers += (f". The state pool holds one slot per --max-num-seqs seat: fewer seats leave more room "
                       "for context")
        if self.draft_kv_bytes_per_block:  # counted in the weights and in the tokens that fit
            levers += (f". The draft model takes {format_bytes(self.draft_weights_bytes)} of weights and "
                       f"{self.draft_kv_bytes_per_block / self.block_size / 1024:.1f} KiB/token of KV beside the "
                       "target's: a smaller draft, or n-gram speculation, leaves more")
        return (f"not even one {self.max_model_len:,}-token sequence fits{where}: {self.usable_bytes / GIB:.2f} GiB "
                f"usable per card ({usable}) − weights {self.weights_bytes / GIB:.2f} GiB − activations "
                f"{self.activation_bytes / GIB:.2f} GiB{overhead} leaves {max(0, self.kv_budget_bytes) / GIB:.2f} GiB "
                f"for the KV cache; at {self.kv_bytes_per_token / 1024:.1f} KiB/token that holds "
                f"{self.num_tokens:,} tokens. {levers}")


@dataclass(frozen=True)
class MemoryProfile:
    """What one rank measured on its card (or what the planner estimates for it)."""

    card: str  # e.g. "cuda:1 (NVIDIA GeForce RTX 3090)"
    total_bytes: int
    free_bytes_at_start: int  # before the engine loaded anything (the desktop holds the rest)
    weights_bytes: int  # allocated after loading
    activation_bytes: int  # peak of the profiling step above what was allocated before it
    overhead_bytes: int  # CUDA graphs and memory allocated outside torch's allocator (context, NCCL)


def state_pool_bytes(layout: KVCacheLayout | None, max_num_seqs: int, enable_prefix_caching: bool = True) -> int:
    """A hybrid model's state pool on one card, its prefix-cache snapshots included (0 for attention-only
    models)."""
    return 0 if layout is None else layout.state_pool_bytes(max_num_seqs, enable_prefix_caching)


def verify_scratch_tokens(max_num_seqs: int, num_speculative_tokens: int, max_num_batched_tokens: int) -> int:
    """Tokens a hybrid model's verify scratch holds (rollback of rejected drafts, engine/spec_decode/
    state_rollback.py): every seat's 1 + k verify tokens, capped by the step's token budget; 0 without
    speculation. The engine reserves exactly this."""
    if num_speculative_tokens <= 0:
        return 0
    return min(max_num_seqs * (1 + num_speculative_tokens), max_num_batched_tokens)


def plan_from_profile(p: MemoryProfile, gpu_memory_utilization: float, kv_bytes_per_token: int, block_size: int,
                      max_model_len: int, tensor_parallel_size: int, layout: KVCacheLayout | None = None,
                      max_num_batched_tokens: int = 0, max_num_seqs: int = 0,
                      enable_prefix_caching: bool = True, draft_kv_bytes_per_block: int = 0) -> CapacityPlan:
    """`draft_kv_bytes_per_block`: a draft model's KV page per block id (its weights are in the profile)."""
    others = p.total_bytes - p.free_bytes_at_start
    usable = int(p.total_bytes * gpu_memory_utilization) - others
    states = state_pool_bytes(layout, max_num_seqs, enable_prefix_caching)
    budget = usable - p.weights_bytes - p.activation_bytes - p.overhead_bytes - states
    return CapacityPlan(p.total_bytes, usable, p.weights_bytes, p.activation_bytes, kv_bytes_per_token, budget,
                        block_size, max_model_len, tensor_parallel_size, p.overhead_bytes, others, p.card,
                        gpu_memory_utilization, layout=layout, max_num_batched_tokens=max_num_batched_tokens,
                        state_bytes=states, draft_kv_bytes_per_block=draft_kv_bytes_per_block)


def plan_from_budget(p: MemoryProfile, kv_budget_bytes: int, kv_bytes_per_token: int, block_size: int,
                     max_model_len: int, tensor_parallel_size: int, layout: KVCacheLayout | None = None,
                     max_num_batched_tokens: int = 0, max_num_seqs: int = 0,
                     enable_prefix_caching: bool = True, draft_kv_bytes_per_block: int = 0) -> CapacityPlan:
    """An absolute KV budget: the pool is `kv_budget_bytes` whatever else the card holds. The plan records the
    card's room after this engine's weights, activations and overhead as `usable_bytes`, so a caller can refuse a
    budget that is larger than the room (`budget_room_error`)."""
    room = p.free_bytes_at_start - p.weights_bytes - p.activation_bytes - p.overhead_bytes
    states = state_pool_bytes(layout, max_num_seqs, enable_prefix_caching)  # the budget holds the state pool too
    return CapacityPlan(p.total_bytes, room, p.weights_bytes, p.activation_bytes, kv_bytes_per_token,
                        kv_budget_bytes - states, block_size, max_model_len, tensor_parallel_size, p.overhead_bytes,
                        0, p.card, layout=layout, max_num_batched_tokens=max_num_batched_tokens, state_bytes=states,
                        draft_kv_bytes_per_block=draft_kv_bytes_per_block)


def budget_room_error(plan: CapacityPlan) -> str | None:
    """Why an absolute KV budget cannot be allocated on its card, or None when the room is there."""
    if plan.kv_budget_bytes <= plan.usable_bytes:
        return None
    where = f" on {plan.card}" if plan.card else ""
    return (f"--kv-cache-memory {plan.kv_budget_bytes / GIB:.2f} GiB does not fit{where}: after this engine's weights "
            f"{plan.weights_bytes / GIB:.2f} GiB, activations {plan.activation_bytes / GIB:.2f} GiB and overhead "
            f"{plan.overhead_bytes / GIB:.2f} GiB only {max(0, plan.usable_bytes) / GIB:.2f} GiB is free; "
            f"{(plan.kv_budget_bytes - max(0, plan.usable_bytes)) / GIB:.2f} GiB is missing. Lower --kv-cache-memory "
            "or free the card")


def other_programs_note(p: MemoryProfile, gpu_memory_utilization: float) -> str | None:
    """A plain sentence when other programs held memory on the card at start (it comes out of the share)."""
    others = p.total_bytes - p.free_bytes_at_start
    if others <= 0:
        return None
    share = p.total_bytes * gpu_memory_utilization
    return (f"{p.card}: other programs (the desktop, other processes) held {others / GIB:.2f} GiB at start; it "
            f"comes out of the engine's {share / GIB:.2f} GiB share ({p.total_bytes / GIB:.2f} GiB × "
            f"--gpu-memory-utilization {gpu_memory_utilization:.2f}), leaving {(share - others) / GIB:.2f} GiB. "
            "Close them or raise --gpu-memory-utilization for a larger KV cache")


def estimate_profile(cfg: ModelConfig, total_bytes: int, *, dtype_bytes: int, tensor_parallel_size: int,
                     max_num_batched_tokens: int, max_num_seqs: int, other_programs_bytes: int = 0,
                     quant_bits: int | None = None, cuda_graphs: bool = False, card: str = "",
                     weights_bytes: int | None = None, activation_bytes: int | None = None,
                     cuda_graph_mode: str = "full_and_piecewise", num_speculative_tokens: int = 0) -> MemoryProfile:
    """The planner's MemoryProfile of one card: what the engine would measure, from the model's shape (with
    `cuda_graphs`, the graphs of `cuda_graph_mode`: piecewise pieces count beside the decode graphs; with
    `num_speculative_tokens`, the verify steps' graphs too, which hybrid models do not capture)."""
    tp = tensor_parallel_size
    weights = weights_bytes if weights_bytes is not None else \
        weights_bytes_per_card(cfg, dtype_bytes, tp, quant_bits) + rope_table_bytes(cfg)
    activations = activation_bytes if activation_bytes is not None else \
        estimate_activation_bytes(cfg, max_num_batched_tokens, dtype_bytes, tp, max_num_seqs)
    graphs = estimate_cuda_graph_bytes(cfg, max_num_seqs, max_num_batched_tokens, dtype_bytes, tp,
                                       cuda_graph_mode) if cuda_graphs else 0
    if cuda_graphs:
        graphs += estimate_verify_graph_bytes(cfg, max_num_seqs, dtype_bytes, tp, num_speculative_tokens)
    return MemoryProfile(card, total_bytes, total_bytes - other_programs_bytes, weights, activations, graphs)


def plan_capacity(cfg: ModelConfig, card_bytes: list[int], gpu_memory_utilization: float, *, dtype: str = "bfloat16",
                  kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1, max_model_len: int | None = None,
                  max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, block_size: int = 16,
                  quantization: str | None = None, other_programs_bytes: list[int] | None = None,
                  cuda_graphs: bool = False, weights_bytes: int | None = None,
                  activation_bytes: int | None = None, window_freeing: bool = True,
                  enable_prefix_caching: bool = True, draft: ModelConfig | None = None,
                  num_speculative_tokens: int = 0, mtp: bool = False,
                  cuda_graph_mode: str = "full_and_piecewise") -> CapacityPlan:
    """The planner on CUDA: each card's estimated profile through `plan_from_profile`; the card with the
    fewest blocks decides, as in the engine (every rank holds the same blocks). `draft`: speculative decoding's
    draft model, whose weights sit on the first card (`weights_bytes`, if given, is the target's alone);
    `num_speculative_tokens`: k of any speculative method, whose verify graphs the CUDA graphs' share counts;
    `mtp`: speculation by the checkpoint's MTP head, counted like a draft on the first card (mtp_footprint, with
    its own full embedding and LM head under tensor parallel)."""
    dtype_bytes = DTYPE_BYTES[dtype]
    kv_bytes = dtype_bytes if kv_cache_dtype == "auto" else DTYPE_BYTES[kv_cache_dtype]
    if max_model_len:
        cfg = dataclasses.replace(cfg, max_model_len=max_model_len)
    layout = model_kv_layout(cfg, block_size, kv_bytes, tensor_parallel_size, window_freeing, dtype_bytes)
    per_token = layout.bytes_per_block // block_size
    quant_bits = None if cfg.quantization is not None else QUANT_BITS.get(quantization)  # the folder's own wins
    others = other_programs_bytes or [0] * len(card_bytes)
    draft_weights, draft_per_block = \
        mtp_footprint(cfg, dtype_bytes, kv_bytes, block_size, tensor_parallel_size) if mtp else \
        draft_footprint(draft, dtype_bytes, kv_bytes, block_size)
    scratch = layout.verify_scratch_bytes(verify_scratch_tokens(max_num_seqs, num_speculative_tokens,
                                                                max_num_batched_tokens))  # allocated before sizing
    plans = []
    for i, (total, other) in enumerate(zip(card_bytes, others)):
        profile = estimate_profile(cfg, total, dtype_bytes=dtype_bytes, tensor_parallel_size=tensor_parallel_size,
                                   max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   other_programs_bytes=other, quant_bits=quant_bits,
                                   cuda_graphs=cuda_graphs, card=f"cuda:{i}" if len(card_bytes) > 1 else "",
                                   weights_bytes=weights_bytes, activation_bytes=activation_bytes,
                                   num_speculative_tokens=num_speculative_tokens, cuda_graph_mode=cuda_graph_mode)
        extra = scratch + (draft_weights if i == 0 else 0)  # the draft runs whole on rank 0
        if extra:
            profile = dataclasses.replace(profile, weights_bytes=profile.weights_bytes + extra)
        plan = plan_from_profile(profile, gpu_memory_utilization, per_token, block_size,
                                 max_model_len or cfg.max_model_len, tensor_parallel_size, layout,
                                 max_num_batched_tokens, max_num_seqs, enable_prefix_caching, draft_per_block)
        plan.draft_weights_bytes = draft_weights if i == 0 else 0
        plans.append(plan)
    return min(plans, key=lambda p: p.num_blocks)


def plan_cpu(cfg: ModelConfig, kv_cache_gib: float, *, dtype: str = "float32", kv_cache_dtype: str = "auto",
             max_model_len: int | None = None, max_num_seqs: int = 256, block_size: int = 16,
             weights_bytes: int | None = None, max_num_batched_tokens: int = 8192,
             window_freeing: bool = True, enable_prefix_caching: bool = True,
             draft: ModelConfig | None = None, draft_weights_bytes: int | None = None,
             num_speculative_tokens: int = 0, mtp: bool = False,
             draft_kv_bytes_per_block: int | None = None) -> CapacityPlan:
    """The CPU engine's pool: --kv-cache-memory bytes of blocks, capped at max_num_seqs full sequences, shared
    with the KV of a `draft` model or the `mtp` head when speculation uses one (estimated from the config; the
    engine passes what its loaded proposer measures instead: `draft_weights_bytes`, `draft_kv_bytes_per_block`);
    a hybrid model's verify scratch under speculation sits beside the weights, outside the KV budget."""
    dtype_bytes = DTYPE_BYTES[dtype]
    kv_bytes = dtype_bytes if kv_cache_dtype == "auto" else DTYPE_BYTES[kv_cache_dtype]
    max_len = max_model_len or cfg.max_model_len
    budget = int(kv_cache_gib * GIB)
    weights = weights_bytes if weights_bytes is not None else weights_bytes_per_card(cfg, dtype_bytes)
    layout = model_kv_layout(cfg, block_size, kv_bytes, 1, window_freeing, dtype_bytes)
    per_seq = layout.blocks_per_seq(max_len, max_num_batched_tokens) if layout.has_sliding_window else \
        -(-max_len // block_size)
    states = state_pool_bytes(layout, max_num_seqs, enable_prefix_caching)  # the budget holds a hybrid's states too
    draft_weights, draft_per_block = mtp_footprint(cfg, dtype_bytes, kv_bytes, block_size) if mtp else \
        draft_footprint(draft, dtype_bytes, kv_bytes, block_size)
    if draft_weights_bytes is not None:
        draft_weights = draft_weights_bytes
    if draft_kv_bytes_per_block is not None:
        draft_per_block = draft_kv_bytes_per_block
    scratch = layout.verify_scratch_bytes(verify_scratch_tokens(max_num_seqs, num_speculative_tokens,
                                                                max_num_batched_tokens))
    return CapacityPlan(budget, budget, weights + draft_weights + scratch, 0, layout.bytes_per_block // block_size,
                        budget - states, block_size, max_len, 1, card="CPU", max_blocks=max_num_seqs * per_seq,
                        layout=layout, max_num_batched_tokens=max_num_batched_tokens, state_bytes=states,
                        draft_weights_bytes=draft_weights, draft_kv_bytes_per_block=draft_per_block)
