"""The capacity planner line: weights per card, KV bytes per token, tokens and full-length sequences.

All arithmetic is the engine's own (`engine.sizing`, torch-free, which reads the model through the
same ModelConfig the engine loads with): this module only gathers inputs — the model's config.json,
the settings form's values, each card's memory from NVML — and returns the plan's summary, or a
plain sentence saying why nothing fits. On CUDA it calls `sizing.plan_capacity` (estimated profiles
through the engine's `plan_from_profile`); without an NVIDIA GPU `sizing.plan_cpu`, the very function
`pagedesk-serve --device cpu` sizes its pool with (--kv-cache-memory, capped at max_num_seqs sequences).
"""
from __future__ import annotations

from typing import Any

from engine import sizing
from engine.config import DEFAULT_CPU_KV_CACHE_GIB, EngineConfig


def _shape(hf_config: dict):
    shape_cls = getattr(sizing, "ModelShape", None) or sizing.ModelConfig
    return shape_cls.from_hf_config(hf_config)


def resolve_dtype(requested: str, model_dtype: str, on_gpu: bool) -> str:
    """What the engine will run in: auto is float32 on CPU, the model's 16-bit dtype (else bf16) on CUDA."""
    if requested not in ("auto", None):
        return {"half": "float16", "float": "float32"}.get(requested, requested)
    if not on_gpu:
        return "float32"
    return model_dtype if model_dtype in ("float16", "bfloat16") else "bfloat16"


def capacity_line(hf_config: dict | None, values: dict[str, Any], gpu_memory_bytes: list[int],
                  gpu_used_bytes: list[int] | None = None) -> str:
    """`gpu_used_bytes`: what other programs hold on each card now (NVML), which the engine will subtract too."""
    if hf_config is None:
        return "Choose a model to see how much fits."
    try:
        cfg = _shape(hf_config).with_max_model_len(values.get("max_model_len"))
        on_gpu = bool(gpu_memory_bytes)
        engine = EngineConfig(max_num_batched_tokens=values.get("max_num_batched_tokens"),
                              enable_chunked_prefill=bool(values.get("enable_chunked_prefill", True)))
        common = dict(dtype=resolve_dtype(values.get("dtype") or "auto", cfg.torch_dtype, on_gpu),
                      kv_cache_dtype=values.get("kv_cache_dtype") or "auto", max_model_len=cfg.max_model_len,
                      block_size=int(values.get("block_size") or 16),
                      max_num_seqs=int(values.get("max_num_seqs") or 256))
        if on_gpu:
            plan = sizing.plan_capacity(
                cfg, gpu_memory_bytes, float(values.get("gpu_memory_utilization") or 0.9),
                tensor_parallel_size=int(values.get("tensor_parallel_size") or 1),
                max_num_batched_tokens=engine.resolve_max_num_batched_tokens(cfg.max_model_len),
                other_programs_bytes=gpu_used_bytes, cuda_graphs=not values.get("enforce_eager"), **common)
            where = f"{len(gpu_memory_bytes)} GPU(s), smallest {min(gpu_memory_bytes) / sizing.GIB:.1f} GiB"
        else:
            budget = values.get("kv_cache_memory") or DEFAULT_CPU_KV_CACHE_GIB
            plan = sizing.plan_cpu(cfg, float(budget), **common)
            where = f"CPU, no NVIDIA GPU: {float(budget):.1f} GiB KV budget"
    except (ValueError, KeyError, TypeError) as e:
        return f"Cannot plan this model: {e}"
    if not plan.fits:
        return f"{where} — {plan.explain_misfit()}"
    return f"{where} — {plan.summary()}"
