"""How many KV blocks to allocate: an explicit override, a CPU memory budget, or CUDA free memory after profiling.

The arithmetic is engine/sizing.py's (shared with the GUI planner); this module only measures: the
weights actually loaded and, on CUDA, the peak of a profiling forward at max_num_batched_tokens.
"""
from __future__ import annotations

import logging

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_GIB, EngineConfig
from engine.model_config import ModelConfig
from engine.sizing import GIB, CapacityPlan, kv_bytes_per_token

logger = logging.getLogger("pagedesk.engine")


def choose_num_blocks(config: EngineConfig, model_config: ModelConfig, runner, kv_dtype: torch.dtype,
                      max_num_batched_tokens: int) -> int:
    tp = config.tensor_parallel_size
    per_token = kv_bytes_per_token(model_config, kv_dtype.itemsize, tp)
    block_bytes = per_token * config.block_size
    min_blocks = -(-model_config.max_model_len // config.block_size)
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if runner.device.type == "cuda":
        plan = profile_cuda(config, model_config, runner, per_token, max_num_batched_tokens)
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


def profile_cuda(config: EngineConfig, model_config: ModelConfig, runner, per_token: int,
                 max_num_batched_tokens: int) -> CapacityPlan:
    device = runner.device
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    allocated_before = torch.cuda.memory_allocated(device)
    runner.profile_run(max_num_batched_tokens)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - allocated_before
    torch.cuda.empty_cache()
    wanted = total * config.gpu_memory_utilization
    others = total - free_before - torch.cuda.memory_reserved(device)  # desktop, other processes
    if free_before + torch.cuda.memory_reserved(device) < wanted:
        logger.warning("only %.2f GiB of %.2f GiB is free on %s, below --gpu-memory-utilization %.2f "
                       "(%.2f GiB); other programs hold %.2f GiB", free_before / GIB, total / GIB, device,
                       config.gpu_memory_utilization, wanted / GIB, others / GIB)
    plan = CapacityPlan(total, int(min(wanted, total - others)), runner.weights_bytes(), activations, per_token,
                        0, config.block_size, model_config.max_model_len, config.tensor_parallel_size)
    plan.kv_budget_bytes = plan.usable_bytes - plan.weights_bytes - plan.activation_bytes - runner.graph_bytes()
    return plan
