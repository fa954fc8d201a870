"""Attention over the paged KV cache: write this step's K/V into their slots, then attend through block tables.

The batch layout travels explicitly in `AttentionMetadata` (no global context); a layer reads the block table
and slots of its KV cache group (`kv_group`, set when the cache is bound); the kernels come from
`kernels.get_attention_backend`, so the torch path (CPU) and the Triton path (CUDA) see identical inputs.
A family picks its attention variant through the constructor: a scale other than ``head_dim ** -0.5``
(Gemma's ``query_pre_attn_scalar``), a sliding window, logit soft-capping (Gemma 2), learned per-head sinks
(gpt-oss; a parameter of this layer, split by head across tensor-parallel ranks), per step, key limits (Gemma's
image tokens see their whole image, `AttentionMetadata.key_limits`) and, per call, an output
gate (Qwen3.5's gated attention: ``out * sigmoid(gate)``, elementwise after the kernel, so no backend
needs it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed.parallel_state import get_tp_rank, get_tp_size
from kernels import get_attention_backend
from kernels.attention_torch import check_variants


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    # KV cache groups past the first (sliding-window models); None with one group. Dummy metadata (profiling,
    # warm-up) leaves them None: every layer then uses the first group's, which is fine for shapes.
    group_block_tables: torch.Tensor | None = None  # [num_groups - 1, num_seqs, max_blocks] int32
    group_slot_mappings: torch.Tensor | None = None  # [num_groups - 1, num_tokens] int64
    # Hybrid models' linear-attention layers (engine/layers/gated_deltanet.py): each sequence's state slot and
    # whether it continues from it. None in dummy metadata: those layers then run on temporary zero states.
    state_indices: torch.Tensor | None = None  # [num_seqs] int32
    has_initial_state: torch.Tensor | None = None  # [num_seqs] bool
    # Speculative verify rows (engine/spec_decode/state_rollback.py): which sequences only read their slot,
    # and the step's token rows of those sequences (kept in each layer's verify scratch, in order).
    state_read_only: torch.Tensor | None = None  # [num_seqs] bool
    verify_token_rows: torch.Tensor | None = None  # [num_verify_tokens] int64
    # Gemma's bidirectional attention within an image (kernels/image_mask.py): per new token, the position its
    # keys may reach, exclusive. None when no token of the step lies in such an image (the plain causal call).
    key_limits: torch.Tensor | None = None  # [num_tokens] int32
    # The Triton chunked DeltaNet kernels' chunk table (kernels/gated_delta_chunks.ChunkTable), built once per step
    # on the host for every DeltaNet layer; None: a layer that needs one reads query_start_loc itself.
    deltanet_chunks: object | None = None
    # The CPU attention kernel's host view of this step's layout per KV cache group (kernels/attention_cpu.py
    # StepLayout), made by the group's first layer for the others: every metadata serves one forward.
    host_layouts: dict | None = None


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None,
                 backend: str = "torch", *, scale: float | None = None, soft_cap: float | None = None,
                 use_sinks: bool = False) -> None:
        """`num_heads`/`num_kv_heads` are this rank's; `scale` defaults to ``head_dim ** -0.5``."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        check_variants(num_heads, sliding_window, soft_cap, None)
        if use_sinks:  # fp32 whatever the model dtype: the kernels add it to fp32 softmax state
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self.load_sinks
        else:
            self.register_parameter("sinks", None)
        self.write_kv_cache, self.paged_attention = get_attention_backend(backend)
        self.k_cache = self.v_cache = torch.empty(0)
        self.host_caches: tuple | None = None
        self.k_scale = self.v_scale = None
        self.kv_group = 0  # which KV cache group's block table this layer reads (engine/kv/kv_cache_interface.py)

    def load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """The checkpoint holds every head's sink; this rank keeps those of its own heads."""
        start, total = get_tp_rank() * self.num_heads, self.num_heads * get_tp_size()
        if tuple(loaded.shape) != (total,):
            raise ValueError(f"attention sinks: checkpoint tensor of shape {tuple(loaded.shape)}, expected "
                             f"({total},) (one per query head)")
        param.data.copy_(loaded[start:start + self.num_heads])

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float | torch.Tensor = 1.0,
                   v_scale: float | torch.Tensor = 1.0) -> None:
        """Per-tensor FP8 scales live on the device as 1-element tensors: kernels read them without a host
        sync and CUDA graphs capture them. 1.0 by default (FP8's relative precision does not depend on a
        scale; it only matters for values beyond ±448, which K/V activations do not reach). An integer cache
        (int8, packed int4) passes its scale tensors ``[num_blocks, block_size, num_kv_heads, head_dim / group]``
        instead: the KV write fills them with the values, every read multiplies by them."""
        self.k_cache, self.v_cache = k_cache, v_cache
        self.host_caches = None  # (k_cache, the CPU kernel's arrays of the caches), made by the first call reading them
        if isinstance(k_scale, torch.Tensor):
            self.k_scale, self.v_scale = k_scale, v_scale
            return
        self.k_scale = torch.full((1,), k_scale, dtype=torch.float32, device=k_cache.device)
        self.v_scale = torch.full((1,), v_scale, dtype=torch.float32, device=k_cache.device)

    def compile_host_kernel(self) -> None:
        """Compile the backend's host kernel (the CPU decode attention) for the bound caches now, at start, not
        on the first request; a backend without one has nothing to do."""
        warm_up = getattr(self.paged_attention, "warm_up", None)
        if warm_up is not None and self.k_cache.numel():
            warm_up(self.k_cache, self.v_cache, self.k_scale, self.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | None,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; gate (gated attention): [T, H, D] or [T, H * D], returns
        ``attention * sigmoid(gate)``. Without metadata (profiling run) attention is skipped."""
        if meta is None or self.k_cache.numel() == 0:
            out = q
        else:
            slot_mapping, block_tables = self.group_tables(meta)
            variants = {}  # only what is set, so the plain call stays the plain call
            checked = {}
            step_layout = getattr(self.paged_attention, "step_layout", None)  # the CPU kernel's host arrays
            if step_layout is not None and meta.seq_lens.device.type == "cpu":
                variants["layout"] = layout = self.layout(step_layout, meta, slot_mapping, block_tables)
                if self.host_caches is None or self.host_caches[0] is not self.k_cache:  # Gemma 4's sharing swaps
                    self.host_caches = (self.k_cache, self.paged_attention.host_caches(self.k_cache, self.v_cache))
                if self.host_caches[1] is not None:
                    variants["caches"] = self.host_caches[1]
                if layout.slots is not None:
                    slot_mapping, checked["checked"] = layout.slots, True
                    if k is not None and getattr(self.paged_attention, "takes_new_kv", False):
                        variants["new_kv"], k = (k, v), None  # the kernel writes them as it reads the caches
            if k is not None:  # None: a layer reading another layer's cache (Gemma 4's KV sharing), or new_kv
                self.write_kv_cache(k, v, self.k_cache, self.v_cache, slot_mapping, self.k_scale, self.v_scale,
                                    **checked)
            if self.soft_cap is not None:
                variants["soft_cap"] = self.soft_cap
            if self.sinks is not None:
                variants["sinks"] = self.sinks
            if meta.key_limits is not None:
                variants["key_limits"] = meta.key_limits
            out = self.paged_attention(q, self.k_cache, self.v_cache, block_tables, meta.seq_lens,
                                       meta.query_start_loc, self.scale, self.sliding_window, self.k_scale,
                                       self.v_scale, **variants)
        if gate is not None:
            out = out * torch.sigmoid(gate.view(out.shape))
        return out

    def group_tables(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's KV cache group's slot mapping and block tables (the first group's in dummy metadata)."""
        if self.kv_group and meta.group_block_tables is not None:
            return meta.group_slot_mappings[self.kv_group - 1], meta.group_block_tables[self.kv_group - 1]
        return meta.slot_mapping, meta.block_tables

    def layout(self, step_layout, meta: AttentionMetadata, slot_mapping: torch.Tensor, block_tables: torch.Tensor):
        """This step's layout (`step_layout`'s) for this layer's KV cache group, made by the group's first layer."""
        group = self.kv_group if meta.group_block_tables is not None else 0
        layouts = meta.host_layouts
        if layouts is None:
            layouts = meta.host_layouts = {}
        if group not in layouts:
            layouts[group] = step_layout(block_tables, meta.seq_lens, meta.query_start_loc, slot_mapping)
        return layouts[group]
