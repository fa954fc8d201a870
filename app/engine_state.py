"""The engine-state snapshot (docs/engine-state.md) as plain data, decoded from its JSON.

`blocks` is base64(zlib(state | ref_count | owner)): n bytes of state, n bytes of ref count, then n
little-endian uint16 owner indices; `block_groups` (several KV cache groups only) is one byte per block;
`image_blocks` lists the blocks holding image tokens (a per-block flag here). `parse_state` turns one SSE payload
into an `EngineState` whose `blocks` is the widget-ready `BlockSnapshot`; hybrid models' `state_slots` and
MoE models' `expert_load` and the CPU-RAM tier's `kv_offload` become their widgets' pictures, `spec_decode` stays
the engine's counters, and `sleep_level` says whether the engine sleeps. Pure functions, no Qt, no I/O.
"""
from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass, field

import numpy as np

from widgets.block_map import BlockSnapshot
from widgets.expert_heatmap import ExpertLoad
from widgets.host_tier import TierPicture
from widgets.state_slots import StateSlotsPicture


@dataclass
class EngineState:
    time: float
    model: str
    device: str
    block_size: int
    num_blocks: int
    blocks: BlockSnapshot
    requests: list[dict] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    prompt_tokens_per_s: float = 0.0
    generation_tokens_per_s: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    weights_bytes: int | None = None
    kv_cache_bytes: int | None = None
    kv_groups: list[str] = field(default_factory=list)  # KV cache group names, when there are several
    spec_decode: dict | None = None  # cumulative speculative-decoding counters, when speculating
    state_slots: StateSlotsPicture | None = None  # hybrid models' state pool
    expert_load: ExpertLoad | None = None  # MoE models: routed tokens per layer and expert this interval
    kv_offload: TierPicture | None = None  # the prefix cache's CPU-RAM tier, when the engine has one
    sleep_level: int = 0  # sleep mode: 0 awake, 1 weights in host RAM, 2 weights dropped


def parse_state_slots(data: dict | None, owners: list[str]) -> StateSlotsPicture | None:
    if not data:
        return None
    kind = np.asarray(data.get("kind") or [], np.uint8)
    owner = np.asarray(data.get("owner") or [], np.uint16)
    if kind.shape != owner.shape or kind.shape[0] != int(data.get("num_slots", kind.shape[0])):
        raise ValueError(f"state_slots has {kind.shape[0]} kinds and {owner.shape[0]} owners for "
                         f"{data.get('num_slots')} slots")
    return StateSlotsPicture(kind, owner, owners, int(data.get("max_snapshots", 0)), int(data.get("slot_bytes", 0)))


def parse_expert_load(data: dict | None) -> ExpertLoad | None:
    if not data:
        return None
    layers = [int(x) for x in data.get("layers") or []]
    tokens = np.asarray(data.get("tokens") or [], np.int64).reshape(len(layers), -1) if layers else None
    if tokens is None or tokens.shape[1] != int(data.get("num_experts", tokens.shape[1])):
        raise ValueError(f"expert_load: {len(layers)} layers and tokens of shape "
                         f"{None if tokens is None else tokens.shape} for {data.get('num_experts')} experts")
    return ExpertLoad(layers, tokens)


def decode_blocks(encoded: str, num_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    raw = zlib.decompress(base64.b64decode(encoded)) if encoded else b""
    if len(raw) != 4 * num_blocks:
        raise ValueError(f"blocks payload has {len(raw)} bytes, expected 4 * num_blocks = {4 * num_blocks}")
    buf = np.frombuffer(raw, np.uint8)
    owner = buf[2 * num_blocks:].view("<u2").astype(np.uint16)
    return buf[:num_blocks].copy(), buf[num_blocks: 2 * num_blocks].copy(), owner


def encode_blocks(state: np.ndarray, ref_count: np.ndarray, owner: np.ndarray) -> str:
    """The inverse of `decode_blocks` (used by demos and tests)."""
    raw = state.astype(np.uint8).tobytes() + ref_count.astype(np.uint8).tobytes() + owner.astype("<u2").tobytes()
    return base64.b64encode(zlib.compress(raw)).decode()


def decode_block_groups(encoded: str, num_blocks: int) -> np.ndarray:
    """Per block: 0 for none, g for kv_groups[g-1]."""
    raw = zlib.decompress(base64.b64decode(encoded))
    if len(raw) != num_blocks:
        raise ValueError(f"block_groups payload has {len(raw)} bytes, expected num_blocks = {num_blocks}")
    return np.frombuffer(raw, np.uint8).copy()


def decode_image_blocks(ids: list | None, num_blocks: int) -> np.ndarray | None:
    """`image_blocks` (ids of blocks holding image tokens) as a bool per block; None when absent or empty."""
    if not ids:
        return None
    image = np.zeros(num_blocks, bool)
    ids = np.asarray(ids, np.int64)
    image[ids[(ids >= 0) & (ids < num_blocks)]] = True
    return image


def parse_state(data: dict) -> EngineState:
    n = int(data.get("num_blocks", 0))
    state, ref_count, owner = decode_blocks(data.get("blocks", ""), n)
    kv_groups = [str(g) for g in data.get("kv_groups") or []]
    groups = decode_block_groups(data["block_groups"], n) if kv_groups and data.get("block_groups") else None
    image = decode_image_blocks(data.get("image_blocks"), n)
    requests = list(data.get("requests") or [])
    owners = [str(r.get("id", "?")) for r in requests]
    memory = data.get("memory") or {}
    return EngineState(
        time=float(data.get("time", 0.0)), model=str(data.get("model", "")), device=str(data.get("device", "")),
        block_size=int(data.get("block_size", 0)), num_blocks=n,
        blocks=BlockSnapshot(state, ref_count, owner, owners, groups,
                             kv_groups if groups is not None else [], image),
        requests=requests, num_running=int(data.get("num_running", 0)), num_waiting=int(data.get("num_waiting", 0)),
        kv_cache_usage=float(data.get("kv_cache_usage", 0.0)),
        prefix_cache_hit_rate=float(data.get("prefix_cache_hit_rate", 0.0)),
        num_preemptions=int(data.get("num_preemptions", 0)),
        prompt_tokens_per_s=float(data.get("prompt_tokens_per_s", 0.0)),
        generation_tokens_per_s=float(data.get("generation_tokens_per_s", 0.0)),
        prompt_tokens_total=int(data.get("prompt_tokens_total", 0)),
        generation_tokens_total=int(data.get("generation_tokens_total", 0)),
        weights_bytes=memory.get("weights_bytes"), kv_cache_bytes=memory.get("kv_cache_bytes"), kv_groups=kv_groups,
        spec_decode=data.get("spec_decode") or None, state_slots=parse_state_slots(data.get("state_slots"), owners),
        expert_load=parse_expert_load(data.get("expert_load")),
        kv_offload=TierPicture.from_dict(data["kv_offload"]) if data.get("kv_offload") else None,
        sleep_level=int(data.get("sleep_level", 0)))
