"""Byte units and the dtypes a plan counts in: GiB and MiB, `format_bytes` for people, `resolve_dtype` (what
--dtype auto becomes where the engine runs) and `kv_dtype_bytes` (--kv-cache-dtype auto follows the model's
dtype). Torch-free, like all of engine/planning/: the GUI imports it.
"""
from __future__ import annotations

from engine.config.model import DTYPE_BYTES

GIB = 1024 ** 3
MIB = 1024 ** 2


def resolve_dtype(requested: str | None, model_dtype: str, on_gpu: bool) -> str:
    """What the engine will run in: auto is float32 on CPU, the model's 16-bit dtype (else bf16) on CUDA."""
    if requested not in ("auto", None):
        return {"half": "float16", "float": "float32"}.get(requested, requested)
    if not on_gpu:
        return "float32"
    return model_dtype if model_dtype in ("float16", "bfloat16") else "bfloat16"


def kv_dtype_bytes(kv_cache_dtype: str, dtype_bytes: int) -> int:
    """Bytes of one K or V element: --kv-cache-dtype auto stores the cache in the model's dtype."""
    return dtype_bytes if kv_cache_dtype == "auto" else DTYPE_BYTES[kv_cache_dtype]


def format_bytes(n: int) -> str:
    """GiB with two decimals from 1 GiB up, MiB below: tiny test models must not read as 0.00 GiB."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB // 10:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"
