"""How many KV blocks to allocate: an explicit override, a CPU memory budget, or each card's memory after profiling.

The arithmetic is engine/sizing.py's (shared with the GUI planner); this module only measures. On CUDA
every tensor-parallel rank measures its own card (`measure_memory`: the weights it loaded, the peak of a
profiling forward at max_num_batched_tokens, memory outside torch's allocator such as NCCL's buffers);
each card gets its own plan, and the pool takes the smallest block count, since every rank must hold the
same blocks: mixed cards (a 3090 next to a 4090, a desktop on one of them) are sized by the card with
the least room.
"""
from __future__ import annotations

import logging

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_GIB, EngineConfig
from engine.model_config import ModelConfig
from engine.sizing import (GIB, CapacityPlan, MemoryProfile, free_memory_shortfall, kv_bytes_per_token,
                           plan_from_profile)

logger = logging.getLogger("pagedesk.engine")


def choose_num_blocks(config: EngineConfig, model_config: ModelConfig, runner, kv_dtype: torch.dtype,
                      max_num_batched_tokens: int) -> int:
    """`runner` is a ModelRunner or the tensor-parallel executor (anything with .device and .profile_memory)."""
    tp = config.tensor_parallel_size
    per_token = kv_bytes_per_token(model_config, kv_dtype.itemsize, tp)
    block_bytes = per_token * config.block_size
    min_blocks = -(-model_config.max_model_len // config.block_size)
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if runner.device.type == "cuda":
        plan = smallest_plan(config, model_config, runner.profile_memory(max_num_batched_tokens), per_token)
        if not plan.fits:
            raise ValueError(plan.explain_misfit())
        return plan.num_blocks
    budget = (config.kv_cache_memory if config.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_GIB) * GIB
    num_blocks = int(budget // block_bytes)
    if num_blocks < min_blocks:
        raise ValueError(f"--kv-cache-memory {budget / GIB:.3f} GiB holds {num_blocks * config.block_size} tokens "
                         f"at {per_token} bytes/token, less than one max_model_len ({model_config.max_model_len}) "
                         "sequence; raise --kv-cache-memory or lower --max-model-len")
    # More blocks than max_num_seqs full-length sequences could ever use is memory for nothing.
    return min(num_blocks, config.max_num_seqs * min_blocks)


def smallest_plan(config: EngineConfig, model_config: ModelConfig, profiles: list[MemoryProfile],
                  per_token: int) -> CapacityPlan:
    """Plan every card from its measurements and return the plan with the fewest blocks (the MIN over ranks)."""
    plans = []
    for profile in profiles:
        note = free_memory_shortfall(profile, config.gpu_memory_utilization)
        if note:
            logger.warning(note)
        plan = plan_from_profile(profile, config.gpu_memory_utilization, per_token, config.block_size,
                                 model_config.max_model_len, config.tensor_parallel_size)
        logger.info("%s: %s", profile.card, plan.summary())
        plans.append(plan)
    return min(plans, key=lambda p: p.num_blocks)


def measure_memory(runner, num_tokens: int) -> MemoryProfile:
    """Run the profiling forward on this rank's card and measure it. Every rank must call this together."""
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    allocated_before = torch.cuda.memory_allocated(device)
    runner.profile_run(num_tokens)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - allocated_before
    torch.cuda.empty_cache()
    free_now, total = torch.cuda.mem_get_info(device)
    # What the process took since start that torch's allocator does not account for (NCCL, cuBLAS workspaces).
    outside_torch = max(0, runner.free_bytes_at_start - free_now - torch.cuda.memory_reserved(device))
    card = f"{device} ({torch.cuda.get_device_name(device)})"
    return MemoryProfile(card, total, runner.free_bytes_at_start, runner.weights_bytes(), activations,
                         outside_torch + runner.graph_bytes())
