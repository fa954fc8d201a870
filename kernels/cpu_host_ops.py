"""A decode step's small float32 ops on the CPU in one native call each (kernels/host_ops.c): the residual add fused
into RMSNorm, SiLU(gate) or GELU-tanh(gate) times up, and the rotary embedding of q and k in place. At a few rows torch
runs each as several ops whose dispatch costs more than their arithmetic, and more again once the step's weights have
streamed through the cache (BENCHMARKS.md).

Each function returns None where it does not apply, and the caller runs torch's ops: anything
`host_gate.eager_cpu_float32` refuses (asked first: a card's tensors and a compile's trace leave at once), more
than `MAX_ELEMENTS` values (prefill chunks, where torch's vectorised, parallel ops win), a
non-contiguous input, `set_enabled(False)` (the engine's `--cpu-linear torch`: torch's ops everywhere), or no
native build (no C compiler: kernels/native_build.py). Results equal torch's to float32 rounding (the sum of
squares runs in another order). Imports nothing of ours outside kernels/.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kernels import native_build
from kernels.host_gate import eager_cpu_float32

SOURCE = Path(__file__).with_name("host_ops.c")
_P, _N, _F = native_build.POINTER, native_build.SIZE, native_build.FLOAT
FUNCTIONS = {"pagedesk_rms_norm": [_P, _P, _P, _F, _F, _N, _N, _P, _P], "pagedesk_silu_mul": [_P, _N, _N, _P],
             "pagedesk_gelu_tanh_mul": [_P, _N, _N, _P], "pagedesk_rope": [_P, _N, _N, _N, _N, _N, _P, _P]}
MAX_ELEMENTS = 32 * 8192  # decode batches of a wide model; a prefill chunk goes to torch
_enabled = True


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = on


def _native():
    """The built library (native_build keeps it per process), None without one or while turned off."""
    return native_build.load(SOURCE, FUNCTIONS) if _enabled else None


def available() -> bool:
    return _native() is not None


def warm_up() -> None:
    """Build (or find in the cache) and load the library now, not in the first request."""
    _native()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(RMSNorm(s) * (weight + offset), s) with s = x + residual (s None without a residual), or None."""
    if not (eager_cpu_float32(x, weight, *(() if residual is None else (residual,)))
            and x.numel() <= MAX_ELEMENTS and x.is_contiguous() and weight.is_contiguous()
            and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))):
        return None
    library = _native()
    if library is None:
        return None
    n = x.shape[-1]
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    library.pagedesk_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                              offset, eps, x.numel() // n if n else 0, n, out.data_ptr(),
                              None if total is None else total.data_ptr())
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of a [..., 2 * width] tensor (gate first), or None."""
    return _gated(gate_up, "pagedesk_silu_mul")


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gelu(gate, approximate="tanh") * up of a [..., 2 * width] tensor (gate first), or None."""
    return _gated(gate_up, "pagedesk_gelu_tanh_mul")


def _gated(gate_up: torch.Tensor, function: str) -> torch.Tensor | None:
    if not (eager_cpu_float32(gate_up) and gate_up.numel() <= 2 * MAX_ELEMENTS and gate_up.is_contiguous()
            and gate_up.shape[-1] % 2 == 0):
        return None
    library = _native()
    if library is None:
        return None
    width = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], width), dtype=torch.float32)
    getattr(library, function)(gate_up.data_ptr(), gate_up.numel() // (2 * width) if width else 0, width,
                               out.data_ptr())
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> bool:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos and sin [T, 1, rotary_dim] (rotary.py's layout) when k's
    heads follow q's in one buffer (the QKV projection's output split by heads): True when done, else False and
    nothing changed."""
    if not eager_cpu_float32(q, k, cos, sin):
        return False
    rows, q_heads, head_dim = q.shape
    if not (q.numel() <= MAX_ELEMENTS and q.stride(2) == 1 and q.stride(1) == head_dim
            and k.stride() == q.stride() and k.shape[0] == rows and k.shape[2] == head_dim
            and k.data_ptr() == q.data_ptr() + 4 * q_heads * head_dim and rotary_dim % 2 == 0
            and cos.is_contiguous() and sin.is_contiguous() and cos.shape[-1] == rotary_dim
            and cos.numel() == rows * rotary_dim):
        return False
    library = _native()
    if library is None:
        return False
    library.pagedesk_rope(q.data_ptr(), rows, q.stride(0), q_heads + k.shape[1], head_dim, rotary_dim,
                          cos.data_ptr(), sin.data_ptr())
    return True
