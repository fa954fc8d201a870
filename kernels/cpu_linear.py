"""Float32 linear layers on the CPU: decode-sized batches through kernels/cpu_rows_gemm.py, the rest `F.linear`.

A decode step multiplies a few rows (one per running sequence) by every weight matrix of the model, so its
linears are bound by how fast the weights stream from memory. The BLAS behind `F.linear` (MKL) packs a weight
into panels before multiplying, a second pass over it: on the 2-core AMD machine a 42 MB model's matrices took
4.1-4.8 ms through `F.linear` for one row and 5.9-9.3 ms for eight, against 1.6-2.3 and 3.3-4.5 ms for the numba
row kernel, which reads each weight row once; the native build (SIMD tiles, the next weights prefetched) takes
10-25% less again (BENCHMARKS.md, "CPU linears"). Up to `MAX_ROWS` rows run there (`NATIVE_MAX_ROWS` on the
native build); above it the GEMM is compute-bound and `F.linear` is as fast.

Backends (`--cpu-linear`): "rows", the native build where a C compiler built it (kernels/native_build.py), else
numba's; "numba", numba's always; "torch", `F.linear` always. Another dtype or device, a non-contiguous weight, a
fake or compiled trace, gradients, or no numba (a GPU machine's bare environment) go to `F.linear`, as does
everything under a TorchDispatchMode, which could not see the kernel's work (a CPU graph tape, an op count).
Results equal `F.linear`'s to float32 rounding (the sums run in another order). Imports nothing of ours outside
kernels/; numba only when a row kernel runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.host_gate import eager_cpu_float32

BACKENDS = ("rows", "numba", "torch")
MAX_ROWS = 16  # numba's kernel: the weight is read twice at 16 rows, still less than the BLAS's pack and read
NATIVE_MAX_ROWS = 32  # the native build still beat F.linear at 48 rows on the 2-core AMD machine: a margin kept
_max_rows = MAX_ROWS  # the loaded kernel's
PARALLEL_MIN_WORK = 1 << 17  # multiply-adds under which waking a thread pool costs more than it gives
_backend = "rows"
_kernels = None  # (parallel, serial, numba's thread count, native?), loaded at the first row kernel call


def set_backend(name: str) -> None:
    """The process's float32 CPU linear: "rows" (decode-sized batches through the native row kernel, else numba's),
    "numba" (through numba's) or "torch"."""
    global _backend, _kernels, _max_rows
    if name not in BACKENDS:
        raise ValueError(f"unknown CPU linear backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != _backend:
        _backend, _kernels, _max_rows = name, None, MAX_ROWS
        if name != "torch":
            _load_kernels()  # now: the row limit is the loaded kernel's


def backend() -> str:
    return _backend


def _load_kernels():
    global _kernels, _backend, _max_rows
    try:
        from numba import get_num_threads

        from kernels.cpu_rows_gemm import native_kernels, rows_gemm_parallel, rows_gemm_serial
    except ImportError:  # no numba: every linear is F.linear
        _backend = "torch"
        return None
    native = native_kernels() if _backend == "rows" else None
    # numba's thread count is fixed when its pool starts (the thread budget's NUMBA_NUM_THREADS): asked once
    _kernels = (*(native or (rows_gemm_parallel, rows_gemm_serial)), get_num_threads(), native is not None)
    _max_rows = NATIVE_MAX_ROWS if native else MAX_ROWS
    return _kernels


def implementation() -> str:
    """Which kernel the row backend runs in this process: "native", "numba", or "torch" (F.linear)."""
    if _backend == "torch" or (_kernels is None and _load_kernels() is None):
        return "torch"
    return "native" if _kernels[3] else "numba"


def threads() -> int:
    """The row kernels' thread count (numba's pool size, which the native pool takes too); 1 under "torch"."""
    return 1 if implementation() == "torch" else _kernels[2]


def _rows_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # The gate first: a card's tensors and a compile's trace leave before any shape is asked (no guard on it).
    return (_backend != "torch" and eager_cpu_float32(x, weight) and x.dim() >= 1
            and x.numel() <= _max_rows * x.shape[-1] and weight.dim() == 2 and weight.stride(1) == 1
            and weight.stride(0) == weight.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; up to MAX_ROWS (NATIVE_MAX_ROWS) float32 rows on the CPU through the row
    kernel. Every tensor op here costs a batch-1 step microseconds: a 2-D contiguous input is used as it is."""
    if not _rows_ok(x, weight) or (_kernels is None and _load_kernels() is None):
        return F.linear(x, weight, bias)
    depth, n_out = x.shape[-1], weight.shape[0]
    flat = x.dim() == 2
    rows = x if flat and x.is_contiguous() else x.reshape(-1, depth).contiguous()
    n_rows = rows.shape[0]
    out = torch.empty((n_rows, n_out), dtype=torch.float32)
    if n_rows:
        parallel, serial, threads, native = _kernels
        if n_rows * n_out * depth < PARALLEL_MIN_WORK:
            threads = 1
        if native:  # raw pointers: no array conversion per call
            args = (rows.data_ptr(), n_rows, depth, weight.data_ptr(), n_out, out.data_ptr())
            if threads > 1:
                parallel(*args, threads)
            else:
                serial(*args)
        else:
            (parallel if threads > 1 else serial)(rows.numpy(), weight.numpy(), out.numpy())
    if bias is not None:
        out += bias
    return out if flat else out.view(*x.shape[:-1], n_out)


def warm_up() -> None:
    """Compile (or load from numba's cache) the row kernels now, so the first real step does not pay for it."""
    if _backend != "torch" and (_kernels is not None or _load_kernels() is not None):
        from kernels.cpu_rows_gemm import warm_up as compile_kernels
        compile_kernels(native=_kernels[3])
