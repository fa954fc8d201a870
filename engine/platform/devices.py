"""Where and in which dtypes the engine runs: the device a --device names, the compute dtype for --dtype, the
KV cache dtype for --kv-cache-dtype. Resolved once at start (engine/executor/startup.py) and used by every rank.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TORCH_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                "half": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu")
    return indexed_device(torch.device(device))


def indexed_device(device: torch.device) -> torch.device:
    """A bare "cuda" as "cuda:N", the current card. Tensors made on "cuda" report cuda:N, but a generator
    made on it keeps no index, and the sampler refuses a generator whose device differs from the logits'."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(dtype: str, model_dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if model_dtype in ("float16", "bfloat16"):
        return TORCH_DTYPES[model_dtype]
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    return KV_CACHE_DTYPES.get(kv_cache_dtype, dtype)
