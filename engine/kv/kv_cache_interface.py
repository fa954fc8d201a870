"""Per-layer KV specs and the KV cache groups built from them (vLLM v1's kv_cache_interface, in our size).

Each attention layer has a spec: full attention, or a sliding window of W tokens. Layers with equal specs
share KV cache groups; every group has its own block table per sequence, drawn from ONE shared block pool.
Hybrid models (Qwen3.5, Qwen3-Next) add a third kind, "state": a linear-attention (Gated DeltaNet) layer keeps
a fixed-size conv state and recurrent state per sequence instead of K/V per token, so its layers form one
state group outside the block pool: each running sequence holds one slot of the state pool
(engine/kv/state_pool.py) for all of them. Attention groups then number the attention layers only (the i-th
attention layer of the model is layer i of the groups); the state group names the model's layer ids. A physical block id therefore has to mean the same
bytes in every group: the cache is `num_slots` per-layer tensors, and block b of group g lives at index b
of slot j for the j-th layer of g. Layers of one kind are split into groups of `num_slots` layers (the last
group of a kind may use fewer slots; its unused slots are the padding cost). A model whose layers all share
one spec is one group of all its layers: exactly the single-table cache it always had.

Torch-free: the engine's managers, the model runner, the KV sizing and the GUI's planner read the same
groups and the same per-group arithmetic from here.
"""
from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION, SLIDING_WINDOW, STATE = "full_attention", "sliding_window", "state"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """A layer that attends to every earlier token: its blocks stay until the sequence ends."""

    block_size: int
    num_kv_heads: int  # on one card
    head_dim: int
    dtype_bytes: int

    kind = FULL_ATTENTION
    sliding_window = None

    @property
    def page_size_bytes(self) -> int:
        """K and V of one block in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def max_blocks_per_seq(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """A layer whose queries see only the last `sliding_window` keys (itself included): blocks that lie
    wholly behind the window of the next token to compute are freed as the sequence grows."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_window: int

    kind = SLIDING_WINDOW

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def window_blocks(self) -> int:
        """Blocks a prefix hit must hold at its end: the next token sees W - 1 earlier keys."""
        return cdiv(self.sliding_window - 1, self.block_size)

    def max_blocks_per_seq(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks a sequence holds in one step: the window behind its first new token plus a chunk
        of new tokens, one more for a window that starts inside a block (vLLM's bound)."""
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return min(cdiv(tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))


KVSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A linear-attention layer's per-sequence state: the causal conv's last K-1 inputs [conv_dim, K-1] in the
    activation dtype, and the recurrent state [num_v_heads, head_k_dim, head_v_dim] in `ssm_dtype_bytes`
    (the checkpoint's mamba_ssm_dtype, float32 in Qwen3.5 whatever the weights). Sizes are one card's."""

    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype_bytes: int
    ssm_dtype_bytes: int = 4

    kind = STATE

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return self.conv_dim, self.conv_kernel - 1

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return self.num_v_heads, self.head_k_dim, self.head_v_dim

    @property
    def slot_bytes(self) -> int:
        """One sequence's state in one layer; it does not grow with the context."""
        return (self.conv_dim * (self.conv_kernel - 1) * self.conv_dtype_bytes
                + self.num_v_heads * self.head_k_dim * self.head_v_dim * self.ssm_dtype_bytes)

    @property
    def verify_token_bytes(self) -> int:
        """One speculative verify token in one layer's verify scratch (engine/spec_decode/state_rollback.py):
        its pre-conv row in the activation dtype, and g and beta in float32."""
        return self.conv_dim * self.conv_dtype_bytes + 2 * self.num_v_heads * 4


@dataclass(frozen=True, slots=True)
class StateGroup:
    spec: StateSpec
    layer_ids: tuple[int, ...]  # model layers; the j-th uses state tensor j

    @property
    def bytes_per_seq(self) -> int:
        return len(self.layer_ids) * self.spec.slot_bytes


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    spec: KVSpec
    layer_ids: tuple[int, ...]  # model layers, in order; the j-th uses cache slot j


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups, and where each layer's K/V live: slot `layer_slots[l]`, block table of `layer_groups[l]`."""

    groups: tuple[KVCacheGroup, ...]
    num_slots: int
    state: StateGroup | None = None  # hybrid models' linear-attention layers: one state slot per sequence

    @property
    def state_bytes_per_seq(self) -> int:
        """Bytes of one sequence's state slot over every linear-attention layer (0 without them)."""
        return 0 if self.state is None else self.state.bytes_per_seq

    def state_pool_bytes(self, max_num_seqs: int, enable_prefix_caching: bool = False) -> int:
        """The state pool: a slot per seat (max_num_seqs bounds the running sequences, forks and beams included),
        plus the prefix cache's state snapshots."""
        return (max_num_seqs + num_state_snapshots(self, enable_prefix_caching)) * self.state_bytes_per_seq

    def verify_scratch_bytes(self, num_verify_tokens: int) -> int:
        """A hybrid model's verify scratch under speculative decoding, over every linear-attention layer: the
        tokens a step may verify (engine/executor/startup.py reserves min(max_num_seqs * (1 + k), the token
        budget)); 0 without linear-attention layers."""
        return 0 if self.state is None else len(self.state.layer_ids) * self.state.spec.verify_token_bytes \
            * num_verify_tokens

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups)

    @property
    def layer_groups(self) -> list[int]:
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layer_ids:
                out[layer] = g
        return out

    @property
    def layer_slots(self) -> list[int]:
        out = [0] * self.num_layers
        for group in self.groups:
            for j, layer in enumerate(group.layer_ids):
                out[layer] = j
        return out

    @property
    def bytes_per_block(self) -> int:
        """One block id across every slot (what the pool's size is counted in)."""
        return self.num_slots * self.groups[0].spec.page_size_bytes

    @property
    def has_sliding_window(self) -> bool:
        return any(g.spec.kind == SLIDING_WINDOW for g in self.groups)

    def group_names(self) -> list[str]:
        """A short name per group for people: "full attention · 10 layers", "window 1024 · 13 layers"."""
        return [("full attention" if g.spec.kind == FULL_ATTENTION else f"window {g.spec.sliding_window}")
                + f" · {len(g.layer_ids)} layer{'s' if len(g.layer_ids) != 1 else ''}" for g in self.groups]

    def blocks_per_seq(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one sequence of max_model_len tokens holds at its peak, over all groups."""
        return sum(g.spec.max_blocks_per_seq(max_model_len, max_num_batched_tokens) for g in self.groups)

    def longest_context(self, num_blocks: int, max_num_batched_tokens: int, max_len_cap: int) -> int:
        """Tokens of the longest single sequence `num_blocks` blocks hold (full groups grow with it, window
        groups stop at their bound); `max_len_cap` when only window groups exist (the pool never limits)."""
        bs = self.groups[0].spec.block_size
        full = sum(1 for g in self.groups if g.spec.kind == FULL_ATTENTION)
        if not full:
            fits = self.blocks_per_seq(max_len_cap, max_num_batched_tokens) <= num_blocks
            return max_len_cap if fits else 0
        lo, hi = 0, num_blocks // full + 1  # in blocks per full group; total need is monotone in it
        while lo < hi:
            mid = (lo + hi + 1) // 2
            need = sum(mid if g.spec.kind == FULL_ATTENTION else
                       min(mid, g.spec.max_blocks_per_seq(mid * bs, max_num_batched_tokens)) for g in self.groups)
            lo, hi = (mid, hi) if need <= num_blocks else (lo, mid - 1)
        return lo * bs


STATE_SNAPSHOTS = 4  # prefix-cache state snapshots a hybrid model keeps (one state slot each)


def num_state_snapshots(layout: "KVCacheLayout", enable_prefix_caching: bool) -> int:
    """Snapshot slots of a hybrid model's prefix cache: a hit restores the state at its end from one. Few: one
    is a whole sequence's state (147 MiB for Qwen3.6-27B on one card), and a shared system prompt needs one."""
    return STATE_SNAPSHOTS if layout.state is not None and enable_prefix_caching else 0


def layer_specs(sliding_windows: list[int | None], block_size: int, num_kv_heads: int, head_dim: int,
                dtype_bytes: int, window_freeing: bool = True) -> list[KVSpec]:
    """One spec per layer from ModelConfig.sliding_windows (None: full attention). Without `window_freeing`
    every layer is treated as full attention (what the cache costs when no block is ever freed)."""
    return [SlidingWindowSpec(block_size, num_kv_heads, head_dim, dtype_bytes, w) if w and window_freeing
            else FullAttentionSpec(block_size, num_kv_heads, head_dim, dtype_bytes) for w in sliding_windows]


def group_size(counts: list[int]) -> int:
    """Slots per group for layer kinds with these layer counts: the size that wastes the fewest padded slots,
    at least the smallest kind's count (so no kind splits into many tiny groups); ties take the larger size
    (fewer groups, fewer block tables per step). Gemma 3 27B (52 window, 10 full) gets 13: 5 groups, 65 slots
    for 62 layers."""
    def padded(g: int) -> int:
        return g * sum(cdiv(c, g) for c in counts)
    return min(range(min(counts), max(counts) + 1), key=lambda g: (padded(g), -g))


def build_layout(specs: list[KVSpec]) -> KVCacheLayout:
    """Group layers by spec: full-attention groups first (a prefix hit is decided there first), then windows
    by size. Every spec must have the same page size, since groups share the pool's block ids."""
    if not specs:
        raise ValueError("a model without attention layers has no KV cache groups")
    by_spec: dict[KVSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer)
    pages = {s.page_size_bytes for s in by_spec}
    if len(pages) > 1:
        raise ValueError(f"layers with different KV page sizes ({sorted(pages)} bytes per block) cannot share one "
                         "block pool yet")
    if len(by_spec) == 1:
        (spec, layers), = by_spec.items()
        return KVCacheLayout((KVCacheGroup(spec, tuple(layers)),), len(layers))
    size = group_size([len(v) for v in by_spec.values()])
    order = sorted(by_spec, key=lambda s: (s.kind != FULL_ATTENTION, s.sliding_window or 0))
    groups = tuple(KVCacheGroup(spec, tuple(by_spec[spec][i:i + size]))
                   for spec in order for i in range(0, len(by_spec[spec]), size))
    return KVCacheLayout(groups, size)


def kv_head_replicas(cfg, tp: int = 1) -> list[int]:
    """Per model layer, how many times each of its K/V heads is stored so that every cache layer's page has
    the same size (groups share block ids). 1 everywhere unless layers differ in KV heads x head_dim (Gemma 4:
    global layers have wider heads and fewer KV heads). Storing a head r times and giving each copy 1/r of
    its query heads is exact (GQA maps query head h to KV head h // group), so kernels stay as they are; the
    copies cost what padding the smaller pages would. KV-sharing layers read their source layer's cache."""
    heads = [max(1, cfg.layer_kv_heads(i) // tp) for i in range(cfg.num_layers)]
    units = {i: heads[i] * cfg.layer_head_dim(i) for i in cfg.cache_layers}
    widest = max(units.values(), default=1)
    replicas = {}
    for i, u in units.items():
        r = widest // u
        if widest % u or (cfg.num_heads // tp) % (heads[i] * r):
            raise ValueError(f"layer {i}'s KV page ({heads[i]} KV heads x {cfg.layer_head_dim(i)} dims on each of "
                             f"{tp} card(s)) cannot be widened to the widest layer's ({widest} values per token) "
                             "to share one block pool")
        replicas[i] = r
    return [replicas.get(cfg.kv_source(i), 1) for i in range(cfg.num_layers)]


def model_kv_layout(cfg, block_size: int, kv_dtype_bytes: int = 2, tp: int = 1,
                    window_freeing: bool = True, act_dtype_bytes: int = 2) -> KVCacheLayout:
    """The layout of a ModelConfig on one of `tp` cards (KV heads split across ranks, at least one each; a hybrid
    model's DeltaNet heads and conv channels split too). `act_dtype_bytes`: the conv state's dtype (the model's).
    Its attention layers are the model's cache layers in order: all attention layers but Gemma 4's KV-sharing
    ones, each with its own heads x head_dim (widened to one page size, kv_head_replicas)."""
    windows = cfg.sliding_windows or [None] * cfg.num_layers
    linear = getattr(cfg, "linear_attention", None)
    replicas = kv_head_replicas(cfg, tp)  # cfg.cache_layers: no linear-attention layer among them
    specs = []
    for i in cfg.cache_layers:
        heads = max(1, cfg.layer_kv_heads(i) // tp) * replicas[i]
        specs += layer_specs([windows[i]], block_size, heads, cfg.layer_head_dim(i), kv_dtype_bytes,
                             window_freeing)
    layout = build_layout(specs)
    if linear is None:
        return layout
    spec = StateSpec(linear.conv_dim // tp, linear.conv_kernel, linear.num_v_heads // tp, linear.head_k_dim,
                     linear.head_v_dim, act_dtype_bytes, linear.ssm_dtype_bytes)
    return KVCacheLayout(layout.groups, layout.num_slots, StateGroup(spec, tuple(linear.layers)))


