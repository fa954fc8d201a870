"""The GUI's engine-state snapshot (docs/engine-state.md): block pool, requests, rates, memory, as JSON.

`collect_raw` runs on the engine thread (the only thread that may touch the LLMEngine) and copies
what it needs; `build_state` turns that copy into the JSON document off the engine thread. Blocks are
packed as base64(zlib(state | ref_count | owner)): one byte of state and one of saturated ref count
per block, then a little-endian uint16 owner index (0 none, k → requests[k-1]). A model with several KV
cache groups adds `kv_groups` (their names) and `block_groups`: base64(zlib(uint8 per block: 0 none,
g → kv_groups[g-1])). An MoE model adds `expert_load`: the tokens routed to each expert of each MoE layer
since the previous document (`ExpertLoadInterval` diffs the engine's cumulative counts). An engine with the prefix
cache's CPU-RAM tier adds `kv_offload`: its size, what it holds and its counters since start. Blocks holding image
tokens are listed by id in `image_blocks` (absent when none).
"""
from __future__ import annotations

import base64
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.core.outputs import BlockPoolSnapshot, EngineStats

ZLIB_LEVEL = 6


@dataclass
class RawState:
    snapshot: BlockPoolSnapshot
    stats: EngineStats
    memory: dict
    device: str


def collect_raw(llm_engine: Any) -> RawState:
    """Engine thread only: copy the block pool (with its per-request rows) and stats at one instant."""
    device = str(getattr(llm_engine, "device", None) or llm_engine.config.device).split(":")[0]  # cuda:0 → cuda
    return RawState(llm_engine.block_pool_snapshot(), llm_engine.get_stats(), dict(llm_engine.memory_usage()), device)


def pack_blocks(snapshot: BlockPoolSnapshot) -> str:
    state = np.asarray(snapshot.state, dtype=np.uint8)
    ref_count = np.minimum(np.asarray(snapshot.ref_count), 255).astype(np.uint8)
    owner = np.asarray(snapshot.owner, dtype=np.int64)
    owner = np.clip(np.where(owner < 0, 0, owner + 1), 0, 65535).astype("<u2")
    raw = state.tobytes() + ref_count.tobytes() + owner.tobytes()
    return base64.b64encode(zlib.compress(raw, ZLIB_LEVEL)).decode("ascii")


def pack_block_groups(snapshot: BlockPoolSnapshot) -> str:
    groups = (np.asarray(snapshot.group, dtype=np.int16) + 1).astype(np.uint8)
    return base64.b64encode(zlib.compress(groups.tobytes(), ZLIB_LEVEL)).decode("ascii")


def unpack_blocks(blocks: str, num_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of pack_blocks (what a client does): (state, ref_count, owner index) arrays."""
    raw = zlib.decompress(base64.b64decode(blocks))
    assert len(raw) == 4 * num_blocks, (len(raw), num_blocks)
    state = np.frombuffer(raw, np.uint8, num_blocks, 0)
    ref_count = np.frombuffer(raw, np.uint8, num_blocks, num_blocks)
    owner = np.frombuffer(raw, "<u2", num_blocks, 2 * num_blocks)
    return state, ref_count, owner


def _requests(raw: RawState) -> list[dict]:
    return [{"id": r.request_id, "status": r.status, "num_blocks": r.num_blocks,
             "num_prompt_tokens": r.num_prompt_tokens, "num_computed_tokens": r.num_computed_tokens,
             "num_generated_tokens": r.num_generated_tokens} for r in raw.snapshot.requests]


class ExpertLoadInterval:
    """Per-interval expert load from cumulative totals: what changed since the previous call. Documents are
    built one at a time (the SnapshotHub collects serially), so one instance per server is enough."""

    def __init__(self) -> None:
        self.previous: dict | None = None

    def since_last(self, totals: dict | None) -> dict | None:
        """{"num_experts", "layers", "tokens"} counted since the previous call (since start the first time);
        None for a dense model."""
        if totals is None:
            return None
        prev, self.previous = self.previous, totals
        if prev is None or prev["layers"] != totals["layers"] or prev["num_experts"] != totals["num_experts"]:
            return totals
        tokens = [[now - before for now, before in zip(row, prev_row)]
                  for row, prev_row in zip(totals["tokens"], prev["tokens"])]
        return {"num_experts": totals["num_experts"], "layers": list(totals["layers"]), "tokens": tokens}


def build_state(raw: RawState, model_name: str, rates: tuple[float, float],
                expert_load: ExpertLoadInterval | None = None) -> dict:
    """The document; `expert_load` keeps the previous totals between documents (without one, an MoE model's
    `expert_load` counts since start)."""
    s = raw.stats
    load = (expert_load or ExpertLoadInterval()).since_last(s.expert_load)
    num_blocks = len(raw.snapshot.state)
    hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
    return {
        "time": time.time(), "model": model_name, "device": raw.device, "block_size": s.block_size,
        "num_blocks": num_blocks, "blocks": pack_blocks(raw.snapshot), "requests": _requests(raw),
        "num_running": s.num_running, "num_waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
        "prefix_cache_hit_rate": hit_rate, "num_preemptions": s.num_preemptions, "sleep_level": s.sleep_level,
        "prompt_tokens_total": s.prompt_tokens_total, "generation_tokens_total": s.generation_tokens_total,
        "prompt_tokens_per_s": rates[0], "generation_tokens_per_s": rates[1],
        "memory": {"weights_bytes": int(raw.memory.get("weights_bytes", 0)),
                   "kv_cache_bytes": int(raw.memory.get("kv_cache_bytes", 0))},
        **({"spec_decode": s.spec_decode} if s.spec_decode is not None else {}),
        **({"expert_load": load} if load is not None else {}),
        **({"kv_offload": s.kv_offload} if s.kv_offload is not None else {}),
        **({"state_slots": raw.snapshot.state_slots} if raw.snapshot.state_slots is not None else {}),
        **({"image_blocks": list(raw.snapshot.image_blocks)} if raw.snapshot.image_blocks else {}),
        **({"kv_groups": raw.snapshot.group_names, "block_groups": pack_block_groups(raw.snapshot)}
           if raw.snapshot.group is not None else {}),
    }
