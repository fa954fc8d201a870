"""The capacity planner line: weights per card, KV bytes per token, tokens and full-length sequences.

All arithmetic is the engine's own (`engine.planning`, torch-free, which reads the model through the
same ModelConfig the engine loads with): this module only gathers inputs — the model's config.json,
the settings form's values, each card's memory from NVML — and returns the plan's summary, or a
plain sentence saying why nothing fits. On CUDA it calls `plan_capacity` (estimated profiles
through the engine's `plan_from_profile`); without an NVIDIA GPU `plan_cpu`, the very function
`pagedesk-serve --device cpu` sizes its pool with (--kv-cache-memory, capped at max_num_seqs sequences).
With speculative decoding by a draft model (the form's `speculative_config`), the draft's own config.json
(its folder, or its snapshot in the Hugging Face cache) adds its weights and its KV page per block, as the
engine counts them. `fits_words` says what a plan means for a user: the longest context one request can
have and how many such requests run at once (the pool's token total is a cap, not an answer: on CPU it is
max_num_seqs × the context for every model). With a CPU-RAM tier (--kv-offloading-size) the line adds the
blocks and tokens it keeps and the host RAM it takes (`engine.planning.offload`, what the engine allocates).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from app.units import plural
from engine.config.flags import DEFAULT_CPU_KV_CACHE_GIB, DEFAULT_MAX_IMAGE_PIXELS, EngineConfig
from engine.config.model import ModelConfig
from engine.config.speculative import parse_speculative_config
from engine.planning.capacity import CapacityPlan
from engine.planning.offload import plan_host_tier
from engine.planning.planner import plan_capacity, plan_cpu
from engine.planning.units import GIB, format_bytes, resolve_dtype


def draft_hf_config(spec) -> dict | None:
    """The draft model's config.json when the settings speculate with one, else None; ValueError naming
    speculative_config.model when its config cannot be found (a hub id not downloaded yet)."""
    if spec is None or spec.method != "draft_model":
        return None
    path = Path(spec.model).expanduser() / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache  # the local cache only: never the network

        try:
            cached = try_to_load_from_cache(spec.model, "config.json")
        except ValueError:  # not a valid repo id either (a folder that does not exist)
            cached = None
        if not isinstance(cached, str):
            raise ValueError(f"speculative_config.model {spec.model!r} has no config.json here (not a folder, "
                             "nor a downloaded hub model)")
        path = Path(cached)
    return json.loads(path.read_text())


def plan_for(hf_config: dict, values: dict[str, Any], gpu_memory_bytes: list[int],
             gpu_used_bytes: list[int] | None = None) -> tuple[str, CapacityPlan]:
    """(where it runs, the engine's plan) for these settings; ValueError/KeyError/TypeError when the model's
    config cannot be planned. `gpu_used_bytes`: what other programs hold on each card now (NVML), which the
    engine will subtract too."""
    cfg = ModelConfig.from_hf_config(hf_config).with_max_model_len(values.get("max_model_len"))
    spec = parse_speculative_config(values.get("speculative_config"))
    draft_config = draft_hf_config(spec)
    draft = None
    if draft_config is not None:
        try:
            draft = ModelConfig.from_hf_config(draft_config).with_max_model_len(cfg.max_model_len)
        except ValueError as exc:  # the engine refuses a draft with a shorter context the same way
            raise ValueError(f"speculative_config.model: {exc}") from None
    on_gpu = bool(gpu_memory_bytes)
    engine = EngineConfig(max_num_batched_tokens=values.get("max_num_batched_tokens"),
                          enable_chunked_prefill=bool(values.get("enable_chunked_prefill", True)),
                          limit_mm_per_prompt=values.get("limit_mm_per_prompt"),
                          mm_processor_kwargs=values.get("mm_processor_kwargs"),
                          serving=True)  # the app runs pagedesk-serve: its step budget sizes the peak
    cfg.with_image_limit(engine.image_limit())  # '{"image": 0}': served as text, no tower planned
    common = dict(dtype=resolve_dtype(values.get("dtype") or "auto", cfg.torch_dtype, on_gpu),
                  kv_cache_dtype=values.get("kv_cache_dtype") or "auto", max_model_len=cfg.max_model_len,
                  block_size=int(values.get("block_size") or 16),
                  max_num_seqs=int(values.get("max_num_seqs") or 256), draft=draft,
                  mtp=spec is not None and spec.method == "mtp")
    if on_gpu:
        plan = plan_capacity(
            cfg, gpu_memory_bytes, float(values.get("gpu_memory_utilization") or 0.9),
            tensor_parallel_size=int(values.get("tensor_parallel_size") or 1),
            max_num_batched_tokens=engine.resolve_max_num_batched_tokens(cfg.max_model_len),
            other_programs_bytes=gpu_used_bytes, cuda_graphs=not values.get("enforce_eager"),
            cuda_graph_mode=values.get("cuda_graph_mode") or "full_and_piecewise",
            num_speculative_tokens=spec.k if spec is not None else 0,
            max_image_pixels=int(values.get("max_image_pixels") or DEFAULT_MAX_IMAGE_PIXELS),
            processor_kwargs=engine.processor_kwargs(), **common)
        return f"{plural(len(gpu_memory_bytes), 'GPU')}, smallest {min(gpu_memory_bytes) / GIB:.1f} GiB", plan
    budget = values.get("kv_cache_memory") or DEFAULT_CPU_KV_CACHE_GIB
    plan = plan_cpu(cfg, float(budget), max_num_batched_tokens=engine.resolve_max_num_batched_tokens(
        cfg.max_model_len), num_speculative_tokens=spec.k if spec is not None else 0, **common)
    return cpu_where(plan, float(budget), common["max_num_seqs"]), plan


def cpu_where(plan: CapacityPlan, budget_gib: float, max_num_seqs: int) -> str:
    """The CPU line names the KV cache the engine will allocate — the Monitor's "KV cache" figure — and the
    budget beside it when the pool is smaller (no more than max_num_seqs full sequences are worth holding)."""
    pool = plan.kv_cache_bytes
    budget = int(budget_gib * GIB)
    if plan.max_blocks is not None and pool < budget and plan.num_blocks == plan.max_blocks:
        return (f"CPU, no NVIDIA GPU: KV cache {format_bytes(pool)} (of a {budget_gib:g} GiB budget: "
                f"{max_num_seqs} full sequences need no more)")
    return f"CPU, no NVIDIA GPU: KV cache {format_bytes(pool)} (--kv-cache-memory {budget_gib:g} GiB)"


def capacity_line(hf_config: dict | None, values: dict[str, Any], gpu_memory_bytes: list[int],
                  gpu_used_bytes: list[int] | None = None) -> str:
    """The planner's sentence: the plan's summary, or why nothing fits, or why the model cannot be planned."""
    if hf_config is None:
        return "Choose a model to see how much fits."
    try:
        where, plan = plan_for(hf_config, values, gpu_memory_bytes, gpu_used_bytes)
    except (ValueError, KeyError, TypeError) as e:
        return cannot_plan(e)
    return describe(where, plan, values.get("kv_offloading_size"))


def describe(where: str, plan: CapacityPlan, tier_gib: float | None = None) -> str:
    return f"{where} — {plan.summary() if plan.fits else plan.explain_misfit()}{tier_words(plan, tier_gib)}"


def tier_words(plan: CapacityPlan, tier_gib: float | None) -> str:
    """" · CPU-RAM tier 64.0 GiB: 262,144 blocks (4,194,304 tokens) of host RAM", or "" without a tier."""
    if not tier_gib:
        return ""
    if plan.layout is None:
        return f" · CPU-RAM tier {tier_gib:g} GiB of host RAM"
    return f" · {plan_host_tier(plan.layout, tier_gib, plan.tensor_parallel_size).summary(plan.block_size)} of host RAM"


def fits_words(plan: sizing.CapacityPlan, max_num_seqs: int) -> str:
    """"32,768 tokens per request · 3 at once": the longest context one request can have, and how many such
    requests run together (the batch limit, --max-num-seqs, at most; then how many the memory would hold)."""
    if not plan.fits:
        return f"one request of at most {plan.num_tokens:,} tokens, not the full {plan.max_model_len:,}"
    memory = dataclasses.replace(plan, max_blocks=None).num_full_seqs  # the CPU pool stops at the batch limit
    at_once = min(memory, max_num_seqs)
    text = f"{plan.max_model_len:,} tokens per request · {at_once:,} at once"
    return text + (f" (memory for {memory:,})" if memory > at_once else "")


def cannot_plan(error: Exception) -> str:
    return f"Cannot plan this model: {error}"
