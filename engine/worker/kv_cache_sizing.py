"""How many KV blocks to allocate: an explicit override, a CPU memory budget, or each card's memory after profiling.

The arithmetic is engine/planning/'s (shared with the GUI planner and the router); this module only measures. On
CUDA every tensor-parallel rank measures its own card (`measure_memory`): what the process holds after loading its
shard, the peak of a profiling step at max_num_batched_tokens (attention over a temporary KV cache, then the sampler
at max_num_seqs × vocab with a grammar bitmask on every row, or under speculative decoding a verify step at
max_num_seqs × (1 + k) rows, while the step's hidden states and logits are still held), memory outside torch's
allocator (CUDA context, cuBLAS, NCCL buffers) and the CUDA graphs' share. A VL model's profile first runs its
tower on the largest image the processor accepts (so the tower's peak is measured); its encoder cache, empty at
start, is set aside by engine/planning/vision.py's rule, the planner's. Each card gets its own plan and the pool
takes the smallest block count, since every rank must hold the same blocks: mixed cards (a 3090 next to a 4090, the
desktop on one of them) are sized by the card with the least room.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from engine.config.flags import DEFAULT_CPU_KV_CACHE_GIB, EngineConfig
from engine.config.model import ModelConfig
from engine.kv.kv_cache_interface import model_kv_layout
from engine.multimodal.inputs import ProfileImage
from engine.planning.capacity import CapacityPlan, MemoryProfile, budget_room_error, other_programs_note, \
    plan_from_budget, plan_from_profile
from engine.planning.planner import plan_cpu
from engine.planning.units import GIB
from engine.planning.vision import encoder_cache_bytes
from engine.platform.devices import kv_storage

logger = logging.getLogger("pagedesk.engine")


def choose_num_blocks(config: EngineConfig, model_config: ModelConfig, runner, kv_dtype: torch.dtype,
                      max_num_batched_tokens: int, proposer=None, num_speculative_tokens: int = 0,
                      max_embeds_per_image: int | None = None, profile_image: ProfileImage | None = None) -> int:
    """`runner` is a ModelRunner or the tensor-parallel executor (anything with .device and .profile_memory);
    `proposer`: speculative decoding's (engine/spec_decode/proposers/base.Proposer), already loaded on rank 0's
    card (so a draft model's or MTP head's weights are in that card's profile), whose own KV takes a page at
    every block id (an explicit override is kept as given); `num_speculative_tokens`: its k, so the profile's
    widest step is a verify step of 1 + k rows per sequence; `max_embeds_per_image`: a VL engine's largest image
    (None: it takes no images), whose encoder cache at its fullest is set aside by the planner's rule on CUDA;
    `profile_image`: that image's size, which every rank's profile makes and encodes before its forward."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    # The model's dtype (a tensor-parallel executor's is its rank-0 runner's): a hybrid's conv states are in it.
    dtype = getattr(getattr(runner, "runner", runner), "dtype",
                    torch.bfloat16 if runner.device.type == "cuda" else torch.float32)
    proposer_per_block = 0 if proposer is None else proposer.kv_bytes_per_block(kv_storage(kv_dtype))
    if runner.device.type == "cuda":
        layout = model_kv_layout(model_config, config.block_size, kv_storage(kv_dtype), config.tensor_parallel_size,
                                 act_dtype_bytes=dtype.itemsize)
        image = () if profile_image is None else (profile_image,)  # a text model's runner is asked as before
        profiles = runner.profile_memory(max_num_batched_tokens, config.max_num_seqs, kv_dtype,
                                         num_speculative_tokens, *image)
        if max_embeds_per_image is not None:  # filled only as images arrive: not in what the profile measured
            cache = encoder_cache_bytes(model_config, max_num_batched_tokens, dtype.itemsize, max_embeds_per_image)
            profiles = [dataclasses.replace(p, encoder_cache_bytes=cache) for p in profiles]
        plan = smallest_plan(config, model_config, profiles, layout.bytes_per_block // config.block_size, layout,
                             max_num_batched_tokens, proposer_per_block)
    else:
        plan = plan_cpu(model_config, config.kv_cache_memory if config.kv_cache_memory is not None
                        else DEFAULT_CPU_KV_CACHE_GIB, dtype=_dtype_name(dtype), kv_cache_dtype=_dtype_name(kv_dtype),
                        max_num_seqs=config.max_num_seqs, block_size=config.block_size,
                        weights_bytes=runner.weights_bytes(), max_num_batched_tokens=max_num_batched_tokens,
                        enable_prefix_caching=config.enable_prefix_caching,
                        draft_weights_bytes=None if proposer is None else proposer.weights_bytes(),
                        draft_kv_bytes_per_block=proposer_per_block)
        logger.info("CPU: %s", plan.summary())
    if not plan.fits:
        raise ValueError(plan.explain_misfit())
    if proposer_per_block:
        logger.info("KV pool: %d blocks, each holding the target's KV and the %s's", plan.num_blocks, proposer.name)
    return plan.num_blocks


def _dtype_name(dtype: torch.dtype) -> str:
    """engine.config.model.DTYPE_BYTES's name of a torch dtype."""
    return {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.int8: "int8",
            torch.uint8: "int4"}.get(dtype, str(dtype).split(".")[-1])


def smallest_plan(config: EngineConfig, model_config: ModelConfig, profiles: list[MemoryProfile],
                  per_token: int, layout=None, max_num_batched_tokens: int = 0,
                  draft_kv_bytes_per_block: int = 0) -> CapacityPlan:
    """Plan every card from its measurements and return the plan with the fewest blocks (the MIN over ranks).
    With --kv-cache-memory the budget is absolute (a sibling engine on the card is not "other programs").
    `layout` (KV cache groups) makes "tokens that fit" count window groups at their bound."""
    plans = []
    for profile in profiles:
        if config.kv_cache_memory is not None:
            plan = plan_from_budget(profile, int(config.kv_cache_memory * GIB), per_token, config.block_size,
                                    model_config.max_model_len, config.tensor_parallel_size, layout,
                                    max_num_batched_tokens, config.max_num_seqs, config.enable_prefix_caching,
                                    draft_kv_bytes_per_block)
            error = budget_room_error(plan)
            if error:
                raise ValueError(error)
            logger.info("%s: absolute KV budget: %s", profile.card, plan.summary())
            plans.append(plan)
            continue
        note = other_programs_note(profile, config.gpu_memory_utilization)
        if note:
            logger.warning(note)
        plan = plan_from_profile(profile, config.gpu_memory_utilization, per_token, config.block_size,
                                 model_config.max_model_len, config.tensor_parallel_size, layout,
                                 max_num_batched_tokens, config.max_num_seqs, config.enable_prefix_caching,
                                 draft_kv_bytes_per_block)
        logger.info("%s: %s", profile.card, plan.summary())
        plans.append(plan)
    return min(plans, key=lambda p: p.num_blocks)


def measure_memory(runner, num_tokens: int, max_num_seqs: int, kv_dtype: torch.dtype,
                   num_speculative_tokens: int = 0, image: ProfileImage | None = None) -> MemoryProfile:
    """Run the profiling step on this rank's card and measure it (a verify step of 1 + k rows per sequence
    under speculative decoding; `image`, a VL model's largest, through its tower first). Every rank must call
    this together."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    held_after_loading = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    temporary_kv_bytes = runner.profile_run(num_tokens, max_num_seqs, kv_dtype, num_speculative_tokens,
                                            *(() if image is None else (image,)))
    torch.cuda.synchronize(device)
    # The temporary KV cache is part of the peak but the real pool takes its place: not an activation.
    activations = max(0, torch.cuda.max_memory_allocated(device) - held_after_loading - temporary_kv_bytes)
    torch.cuda.empty_cache()
    free_now, total = torch.cuda.mem_get_info(device)
    # What the process took since start that torch's allocator does not account for (cuBLAS, NCCL).
    outside_torch = max(0, runner.free_bytes_at_start - free_now - torch.cuda.memory_reserved(device))
    card = f"{device} ({torch.cuda.get_device_name(device)})"
    logger.info("%s: holds %.2f GiB after loading, profiling peak %.2f GiB above it, %.2f GiB outside torch",
                card, held_after_loading / GIB, activations / GIB, outside_torch / GIB)
    return MemoryProfile(card, total, runner.free_bytes_at_start, held_after_loading, activations,
                         outside_torch + runner.graph_bytes())
