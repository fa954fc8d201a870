"""KVPools: this rank's paged KV cache and a hybrid model's state pool, allocated, bound to the layers, edited in place.

The KV cache is one tensor of `[num_slots, 2, num_blocks, block_size, kv_heads, head_dim]`: one cache slot per
layer that keeps its own K/V (engine/kv/kv_cache_interface.py), each layer viewing its slot's pages its way and
reading them through its group's block table. A hybrid model's linear-attention layers also get per-layer conv
and recurrent states, one slot per sequence, read and written in place through the sequences' slot indices.
Before each forward the step's in-place edits land here, in order: copy-on-write block copies, the previous
verify step's accepted tokens replayed into their state slots, then state copies (forks, prefix-cache
snapshots). It never decides which blocks or slots a sequence holds: the engine's KV managers do.
"""
from __future__ import annotations

import torch

from engine.kv.block_pool import kv_pages
from engine.kv.kv_cache_interface import KVCacheLayout
from engine.platform.host_copies import to_device
from engine.spec_decode.state_rollback import StateReplay


class KVPools:
    def __init__(self, model, layout: KVCacheLayout, device: torch.device, dtype: torch.dtype,
                 block_size: int) -> None:
        self.model, self.layout, self.device, self.dtype, self.block_size = model, layout, device, dtype, block_size
        self.kv_cache: torch.Tensor | None = None
        self.state_cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # per linear-attention layer: conv, ssm

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """One tensor per cache slot; without sliding windows that is one slot per layer and a single group. Its
        pages are the pool's blocks and page 0, the reserved null block's (engine/kv/block_pool.py)."""
        self.allocate_pages(kv_pages(num_blocks), kv_dtype)

    def allocate_pages(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """allocate_kv_cache's tensors at exactly `num_blocks` pages, 0 included (the profiling step's tables
        name pages 0..n-1 themselves and hand none to the block pool)."""
        attn = self.model.attention_layers()
        layout = self.layout
        shape = (layout.num_slots, 2, num_blocks, self.block_size, attn[0].num_kv_heads, attn[0].head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        for layer, slot, group in zip(attn, layout.layer_slots, layout.layer_groups):
            # Layers may differ in heads x head_dim (Gemma 4), never in page size: each views its slot its way.
            page = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_cache(self.kv_cache[slot, 0].view(page), self.kv_cache[slot, 1].view(page))
            layer.kv_group = group

    def allocate_state_cache(self, num_slots: int, padding_slot: bool = False) -> None:
        """Per linear-attention layer a conv state [num_slots, C, K-1] in the model dtype and a recurrent state
        [num_slots, Hv, Dk, Dv] in mamba_ssm_dtype (float32), zeroed. With `padding_slot` one more slot,
        `num_slots`, that no sequence ever holds (the decode graphs' padding rows update it)."""
        spec = self.layout.state.spec
        ssm_dtype = {4: torch.float32, 2: torch.bfloat16}[spec.ssm_dtype_bytes]
        total = num_slots + padding_slot
        self.state_cache = []
        for layer in self.model.state_layers():  # this rank's heads and channels (the layer knows its split)
            conv = torch.zeros((total, layer.conv_state_channels, layer.conv_kernel - 1), dtype=self.dtype,
                               device=self.device)
            ssm = torch.zeros((total, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim), dtype=ssm_dtype,
                              device=self.device)
            layer.bind_state(conv, ssm)
            self.state_cache.append((conv, ssm))

    def reserve_verify_tokens(self, num_tokens: int) -> None:
        """Every linear-attention layer's verify scratch for `num_tokens` speculative verify tokens a step."""
        for layer in self.model.state_layers():
            layer.reserve_verify_rows(num_tokens, self.dtype, self.device)

    def release_kv_cache(self) -> None:
        """Drop the cache (the profiling run's temporary one); layers then skip attention until rebound."""
        self.kv_cache = None
        for layer in self.model.attention_layers():
            layer.bind_cache(torch.empty(0, device=self.device), torch.empty(0, device=self.device))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (src, dst) block's pages in every cache slot."""
        if copies and self.kv_cache is not None:
            pairs = to_device(torch.tensor(copies, dtype=torch.long), self.device)
            src, dst = pairs[:, 0], pairs[:, 1]
            cache = self.kv_cache.view(torch.uint8) if self.kv_cache.element_size() == 1 else self.kv_cache
            cache[:, :, dst] = cache[:, :, src]

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

    def state_slot_bytes(self) -> int:
        """One state slot over this rank's linear-attention layers (0 without them)."""
        if self.layout.state is None:
            return 0
        ssm_bytes = self.layout.state.spec.ssm_dtype_bytes
        return sum(layer.conv_state_channels * (layer.conv_kernel - 1) * self.dtype.itemsize
                   + layer.num_v_heads * layer.head_k_dim * layer.head_v_dim * ssm_bytes
                   for layer in self.model.state_layers())

    def kv_cache_bytes(self) -> int:
        """The paged KV cache and a hybrid model's state pool."""
        states = sum(t.numel() * t.element_size() for pair in self.state_cache for t in pair)
        return states + (0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size())
