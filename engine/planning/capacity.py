"""The capacity plan of one card: KV bytes = what the card may use − what this process holds − its step's peak, and
how many blocks, tokens and full-length sequences that is; or why nothing fits, in a sentence with the numbers.

On CUDA the engine measures every card (`MemoryProfile`: free memory at start, what it holds after loading, the
peak of a profiling forward with attention and the sampler, memory outside torch's allocator, CUDA graphs) and
`plan_from_profile` turns it into a plan; the planner builds the same `MemoryProfile` from estimates
(engine/planning/planner.py) and calls the same function. The formula is vLLM v1's / nano-vllm's:

    KV bytes = total × gpu_memory_utilization − (what other programs held at start) − (this process's peak)
    blocks   = KV bytes // (KV bytes per token per card × block_size)

On CUDA an explicit --kv-cache-memory is an absolute budget (vLLM's --kv-cache-memory-bytes, `plan_from_budget`):
what else holds memory on the card is not subtracted, so the router can place several engines on one card, each
sized by its own budget instead of seeing its siblings as "other programs".

Models with sliding-window layers (engine/kv/kv_cache_interface.py) count a block id across every cache slot,
and a sequence's need per group: a full-attention group grows with the context, a window group stops at the
window plus one step's chunk. So "tokens that fit" is the longest single context the pool holds, and
"full-length sequences" divides the pool by one sequence's peak over all groups. A draft model's or MTP head's
KV page at every block id shares the budget in proportion (`blocks_with_draft`); a hybrid model's state pool
comes out of the budget first (`state_bytes`), and a VL model's encoder cache at its fullest beside the weights
(`encoder_cache_bytes`: not there when the engine profiles, so counted by rule). Torch-free: the GUI's planner imports
it.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.kv.kv_cache_interface import KVCacheLayout
from engine.planning.kv import blocks_with_draft, state_pool_bytes
from engine.planning.units import GIB, format_bytes


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
    encoder_cache_bytes: int = 0  # per card: a VL model's image embeddings at the encoder cache's fullest

    @property
    def num_blocks(self) -> int:
        blocks = max(0, self.kv_budget_bytes // (self.kv_bytes_per_token * self.block_size))
        blocks = blocks if self.max_blocks is None else min(blocks, self.max_blocks)
        return blocks_with_draft(blocks, self.kv_bytes_per_token * self.block_size, self.draft_kv_bytes_per_block)

    @property
    def kv_cache_bytes(self) -> int:
        """The target's KV pool the engine allocates (num_blocks pages; a draft's pages are beside it)."""
        return self.num_blocks * self.kv_bytes_per_token * self.block_size

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
        if self.encoder_cache_bytes:
            groups += f" · encoder cache {format_bytes(self.encoder_cache_bytes)}/card"
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
        if self.encoder_cache_bytes:
            overhead += f" − encoder cache {self.encoder_cache_bytes / GIB:.2f} GiB"
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
    # A VL model's encoder cache at its fullest (engine/planning/vision.py): not allocated when the engine profiles
    # (it fills as images arrive), so set aside by rule beside the measurements, by the engine and planner alike.
    encoder_cache_bytes: int = 0


def plan_from_profile(p: MemoryProfile, gpu_memory_utilization: float, kv_bytes_per_token: int, block_size: int,
                      max_model_len: int, tensor_parallel_size: int, layout: KVCacheLayout | None = None,
                      max_num_batched_tokens: int = 0, max_num_seqs: int = 0,
                      enable_prefix_caching: bool = True, draft_kv_bytes_per_block: int = 0) -> CapacityPlan:
    """`draft_kv_bytes_per_block`: a draft model's KV page per block id (its weights are in the profile)."""
    others = p.total_bytes - p.free_bytes_at_start
    usable = int(p.total_bytes * gpu_memory_utilization) - others
    states = state_pool_bytes(layout, max_num_seqs, enable_prefix_caching)
    budget = usable - p.weights_bytes - p.activation_bytes - p.overhead_bytes - p.encoder_cache_bytes - states
    return CapacityPlan(p.total_bytes, usable, p.weights_bytes, p.activation_bytes, kv_bytes_per_token, budget,
                        block_size, max_model_len, tensor_parallel_size, p.overhead_bytes, others, p.card,
                        gpu_memory_utilization, layout=layout, max_num_batched_tokens=max_num_batched_tokens,
                        state_bytes=states, draft_kv_bytes_per_block=draft_kv_bytes_per_block,
                        encoder_cache_bytes=p.encoder_cache_bytes)


def plan_from_budget(p: MemoryProfile, kv_budget_bytes: int, kv_bytes_per_token: int, block_size: int,
                     max_model_len: int, tensor_parallel_size: int, layout: KVCacheLayout | None = None,
                     max_num_batched_tokens: int = 0, max_num_seqs: int = 0,
                     enable_prefix_caching: bool = True, draft_kv_bytes_per_block: int = 0) -> CapacityPlan:
    """An absolute KV budget: the pool is `kv_budget_bytes` whatever else the card holds. The plan records the
    card's room after this engine's weights, activations and overhead as `usable_bytes`, so a caller can refuse a
    budget that is larger than the room (`budget_room_error`)."""
    room = p.free_bytes_at_start - p.weights_bytes - p.activation_bytes - p.overhead_bytes - p.encoder_cache_bytes
    states = state_pool_bytes(layout, max_num_seqs, enable_prefix_caching)  # the budget holds the state pool too
    return CapacityPlan(p.total_bytes, room, p.weights_bytes, p.activation_bytes, kv_bytes_per_token,
                        kv_budget_bytes - states, block_size, max_model_len, tensor_parallel_size, p.overhead_bytes,
                        0, p.card, layout=layout, max_num_batched_tokens=max_num_batched_tokens, state_bytes=states,
                        draft_kv_bytes_per_block=draft_kv_bytes_per_block, encoder_cache_bytes=p.encoder_cache_bytes)


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
