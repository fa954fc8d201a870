"""StartedEngine: what the engine core is handed once an executor is running — the model loaded on every rank,
the KV cache sized and allocated, graphs captured, the speculative proposer built — and what was read on the way
(the model's folder, config and tokenizer). Plain data: the starting side (engine/executor/startup.py) fills it,
the core (engine/core/engine_core.py) takes it, and neither imports the other's machinery."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config.model import ModelConfig
from engine.config.speculative import SpeculativeConfig
from engine.kv.kv_cache_interface import KVCacheLayout
from engine.planning.offload import HostTierPlan


@dataclass
class StartedEngine:
    model_path: Path
    model_config: ModelConfig
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    runner: Any  # a ModelRunner, or the TensorParallelExecutor driving rank 0 and its workers
    max_num_batched_tokens: int
    kv_layout: KVCacheLayout
    num_blocks: int
    num_state_slots: int  # a hybrid model's seats in the state pool (0 without linear-attention layers)
    num_state_snapshots: int  # prefix-cache state snapshots after them
    spec_config: SpeculativeConfig | None = None
    proposer: Any = None  # engine/spec_decode/proposers/base.Proposer, when speculating
    host_tier: HostTierPlan | None = None  # the prefix cache's CPU-RAM tier, allocated on every rank
    images: Any = None  # engine/core/image_inputs.ImageInputs, built before sizing (None: the core builds its own)
