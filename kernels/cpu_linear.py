"""Float32 linear layers on the CPU: decode-sized batches through kernels/cpu_rows_gemm.py, the rest `F.linear`.

A decode step multiplies a few rows (one per running sequence) by every weight matrix of the model, so its
linears are bound by how fast the weights stream from memory. The BLAS behind `F.linear` (MKL) packs a weight
into panels before multiplying, a second pass over it: on the 2-core AMD machine a 42 MB model's matrices took
4.1-4.8 ms through `F.linear` for one row and 5.9-9.3 ms for eight, against 1.6-2.3 and 3.3-4.5 ms for the row
kernel, which reads each weight row once (BENCHMARKS.md, "CPU linears"). Up to `MAX_ROWS` rows run there; above
it the GEMM is compute-bound and `F.linear` is as fast. Another dtype or device, a non-contiguous weight, a fake
or compiled trace, gradients, or no numba (a GPU machine's bare environment) go to `F.linear`, as does
everything under `set_backend("torch")` (`--cpu-linear torch`) and under a TorchDispatchMode, which could not
see the kernel's work (a CPU graph tape, an op count). Results equal `F.linear`'s to float32 rounding
(the sums run in another order). Imports nothing of ours outside kernels/; numba only when a row kernel runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

BACKENDS = ("rows", "torch")
MAX_ROWS = 16  # the weight is read twice at 16 rows: still less than the BLAS's pack and read
PARALLEL_MIN_WORK = 1 << 17  # multiply-adds under which waking numba's pool costs more than it gives
_backend = "rows"
_kernels = None  # (parallel, serial, numba's thread count), loaded at the first row kernel call


def set_backend(name: str) -> None:
    """The process's float32 CPU linear: "rows" (decode-sized batches through the row kernel) or "torch"."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown CPU linear backend {name!r}; choose one of {', '.join(BACKENDS)}")
    _backend = name


def backend() -> str:
    return _backend


def _load_kernels():
    global _kernels, _backend
    try:
        from numba import get_num_threads

        from kernels.cpu_rows_gemm import rows_gemm_parallel, rows_gemm_serial
    except ImportError:  # no numba: every linear is F.linear
        _backend = "torch"
        return None
    _kernels = rows_gemm_parallel, rows_gemm_serial, get_num_threads
    return _kernels


def _rows_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # type() is exact on purpose: FakeTensor and other subclasses have no storage numba could read.
    return (_backend == "rows" and type(x) is torch.Tensor and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dim() >= 1 and x.numel() <= MAX_ROWS * x.shape[-1] and weight.dim() == 2
            and weight.stride(1) == 1 and weight.stride(0) == weight.shape[1]
            and not (x.requires_grad or weight.requires_grad) and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None)  # a mode (a graph tape, an op count) sees F.linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; up to MAX_ROWS float32 rows on the CPU through the row kernel."""
    if not _rows_ok(x, weight) or (_kernels is None and _load_kernels() is None):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)
    if rows.shape[0]:
        parallel, serial, num_threads = _kernels
        work = rows.shape[0] * weight.shape[0] * weight.shape[1]
        kernel = parallel if work >= PARALLEL_MIN_WORK and num_threads() > 1 else serial
        kernel(rows.numpy(), weight.numpy(), out.numpy())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def warm_up() -> None:
    """Compile (or load from numba's cache) the row kernels now, so the first real step does not pay for it."""
    if _backend == "rows" and (_kernels is not None or _load_kernels() is not None):
        from kernels.cpu_rows_gemm import warm_up as compile_kernels
        compile_kernels()
