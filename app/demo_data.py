"""Synthetic but plausible engine data for screenshots and demos: block pools, state series, GPU readings.

Everything here is made up on purpose and labelled as such by its callers; it exists so the views
can be shown (and their pictures kept in docs/) on a machine without GPUs or a running engine.
"""
from __future__ import annotations

import math

import numpy as np

from app.engine_state import EngineState
from widgets.block_map import STATE_CACHED, STATE_IN_USE, BlockSnapshot
from widgets.expert_heatmap import ExpertLoad
from widgets.gpu_panel import GIB, GpuReading
from widgets.state_slots import SLOT_SEQUENCE, SLOT_SNAPSHOT, StateSlotsPicture


def demo_blocks(num_blocks: int = 4096, num_requests: int = 12, seed: int = 0) -> BlockSnapshot:
    """Requests sharing a 6-block system-prompt prefix, interleaved decode growth, cached leftovers."""
    rng = np.random.default_rng(seed)
    state = np.zeros(num_blocks, np.uint8)
    ref = np.zeros(num_blocks, np.uint8)
    owner = np.zeros(num_blocks, np.uint16)
    prefix = 6
    state[:prefix], ref[:prefix], owner[:prefix] = STATE_IN_USE, num_requests, 1
    cursor = prefix
    sizes = rng.integers(20, 260, num_requests)
    remaining = sizes.copy()
    while remaining.any() and cursor < num_blocks * 0.8:
        for r in np.flatnonzero(remaining):
            chunk = int(min(remaining[r], rng.integers(1, 9), num_blocks - cursor))
            state[cursor: cursor + chunk], ref[cursor: cursor + chunk], owner[cursor: cursor + chunk] = \
                STATE_IN_USE, 1, r + 1
            cursor += chunk
            remaining[r] -= chunk
    freed = rng.random(cursor) < 0.06  # finished requests left reusable prefix blocks behind
    freed[:prefix] = False
    state[:cursor][freed], ref[:cursor][freed], owner[:cursor][freed] = STATE_CACHED, 0, 0
    tail = slice(cursor, min(num_blocks, cursor + 300))
    state[tail] = np.where(rng.random(tail.stop - tail.start) < 0.5, STATE_CACHED, 0)
    owners = [f"chatcmpl-{1000 + i:x}" for i in range(num_requests)]
    return BlockSnapshot(state, ref, owner, owners)


# A Gemma-3-27B-shaped pool: 10 full-attention layers in one group, 52 window layers in four groups of 13.
DEMO_GROUP_NAMES = ["full attention · 10 layers"] + ["window 1024 · 13 layers"] * 4


def demo_grouped_blocks(num_blocks: int = 4096, seed: int = 0) -> BlockSnapshot:
    """demo_blocks with each in-use block in a KV cache group: a request's full-attention blocks grow with its
    length, each window group holds about 64 blocks (1024 tokens) of it, so most of a long request's blocks
    are full-attention ones."""
    blocks = demo_blocks(num_blocks, seed=seed)
    rng = np.random.default_rng(seed + 1)
    group = np.zeros(num_blocks, np.uint8)
    in_use = np.flatnonzero(blocks.state == STATE_IN_USE)
    group[in_use] = np.where(rng.random(in_use.size) < 0.55, 1, rng.integers(2, 6, in_use.size))
    return BlockSnapshot(blocks.state, blocks.ref_count, blocks.owner, blocks.owners, group, list(DEMO_GROUP_NAMES))


def demo_states(num_samples: int = 480, hz: float = 4.0, num_blocks: int = 4096) -> list[tuple[float, EngineState]]:
    """Two minutes of a burst: load ramps up, a prefill spike, steady decode, the start of draining.

    The last sample's KV usage matches the block map's in-use fraction, and its running requests are the ones
    holding blocks, so the views agree."""
    num_requests = 12
    blocks = demo_blocks(num_blocks, num_requests)
    in_use = float(np.mean(blocks.state == STATE_IN_USE))
    final_load = math.sin(math.pi * 0.75) ** 0.7
    out = []
    for i in range(num_samples):
        t = i / hz
        phase = 0.75 * (i + 1) / num_samples
        load = math.sin(math.pi * phase) ** 0.7
        busy = int(round(num_requests * load))  # how hard the engine works
        running = min(num_requests, int(round(num_requests * load / final_load)))  # at the end: all holding blocks
        waiting = max(0, int(round(8 * math.sin(2.5 * math.pi * phase) * load)))
        prompt_rate = 2500 * math.exp(-((phase - 0.3) / 0.05) ** 2) + 300 * load + 80 * ((i * 7919) % 13) / 13
        gen_rate = 38 * busy * (1 - 0.02 * busy) + 5 * ((i * 104729) % 7) / 7
        usage = in_use * load / final_load
        state = EngineState(
            time=t, model="Qwen/Qwen2.5-7B-Instruct", device="cuda", block_size=16, num_blocks=num_blocks,
            blocks=blocks, requests=[{"id": o} for o in blocks.owners], num_running=running, num_waiting=waiting,
            kv_cache_usage=usage, prefix_cache_hit_rate=0.18 * load, num_preemptions=0,
            prompt_tokens_per_s=prompt_rate, generation_tokens_per_s=gen_rate,
            prompt_tokens_total=int(180_000 * phase), generation_tokens_total=int(52_000 * phase),
            weights_bytes=int(7.1 * GIB), kv_cache_bytes=int(12.4 * GIB))
        out.append((t, state))
    return out


def demo_hybrid_moe_states(num_samples: int = 240, hz: float = 4.0) -> list[tuple[float, EngineState]]:
    """demo_states' last minute as a hybrid MoE model speculating with its MTP head would report it: a state
    slot per running request plus prefix-cache snapshots, acceptance counters that grow by ~1.9 accepted
    drafts of 3 per verify step, and a router that favours a few experts per layer."""
    import dataclasses
    base = demo_states(num_samples)
    rng = np.random.default_rng(5)
    layers, experts, top_k = list(range(40)), 256, 8
    favour = rng.gamma(0.6, size=(len(layers), experts)) + 0.05
    favour /= favour.sum(axis=1, keepdims=True)
    drafts = proposed = accepted = 0
    out = []
    for t, state in base:
        kind = np.zeros(20, np.uint8)
        owner = np.zeros(20, np.uint16)
        kind[:state.num_running] = SLOT_SEQUENCE
        owner[:state.num_running] = np.arange(1, state.num_running + 1)
        kind[16:] = SLOT_SNAPSHOT
        steps = max(1, int(state.generation_tokens_per_s / hz / 2.9))
        drafts, proposed = drafts + steps, proposed + 3 * steps
        accepted += int(steps * (1.9 + 0.2 * math.sin(t / 7)))
        tokens = np.stack([rng.multinomial(int(state.generation_tokens_per_s / hz) * top_k, row) for row in favour])
        out.append((t, dataclasses.replace(
            state, model="Qwen/Qwen3.6-35B-A3B",
            state_slots=StateSlotsPicture(kind, owner, state.blocks.owners, 4, 64_389_120),
            spec_decode={"method": "mtp", "num_speculative_tokens": 3, "num_drafts": drafts,
                         "num_draft_tokens": proposed, "num_accepted_tokens": accepted},
            expert_load=ExpertLoad(layers, tokens))))
    return out


def demo_gpu_readings(t: float = 0.0) -> list[GpuReading]:
    wobble = math.sin(t / 3)
    return [GpuReading(0, "NVIDIA GeForce RTX 4090", int((21.3 + 0.2 * wobble) * GIB), 24 * GIB,
                       int(91 + 5 * wobble), 67, 388.0 + 20 * wobble, 450.0),
            GpuReading(1, "NVIDIA GeForce RTX 4090", int((21.1 + 0.2 * wobble) * GIB), 24 * GIB,
                       int(88 + 6 * wobble), 63, 362.0 + 25 * wobble, 450.0)]


def demo_model_folder(folder) -> None:
    """A config.json and a header-only safetensors index shaped like Qwen2.5-7B (no weights at all)."""
    import json
    import struct
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
              "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
              "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    h, i, kv = 3584, 18944, 4 * 128
    tensors = {"model.embed_tokens.weight": [152064, h], "lm_head.weight": [152064, h], "model.norm.weight": [h]}
    for layer in range(28):
        p = f"model.layers.{layer}."
        tensors |= {p + "self_attn.q_proj.weight": [h, h], p + "self_attn.q_proj.bias": [h],
                    p + "self_attn.k_proj.weight": [kv, h], p + "self_attn.k_proj.bias": [kv],
                    p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.v_proj.bias": [kv],
                    p + "self_attn.o_proj.weight": [h, h], p + "mlp.gate_proj.weight": [i, h],
                    p + "mlp.up_proj.weight": [i, h], p + "mlp.down_proj.weight": [h, i],
                    p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]}
    header = {name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]} for name, shape in tensors.items()}
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
