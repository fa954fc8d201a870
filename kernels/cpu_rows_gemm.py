"""A float32 GEMM for a few rows on the CPU that reads each weight row once: the native build and numba's.

`out[m, n] = sum_k x[m, k] * w[n, k]`, w in torch's [out, in] layout. Parallel over output features, so a decode
step's weights stream from memory once, with no packing pass (the BLAS GEMMs' first pass over the weights). Two
builds of the same loop:
- native (`native_kernels`): kernels/rows_gemm.c, built for this CPU by kernels/native_build.py: tiles of 3 weight
  rows by 4 input rows in SIMD registers and the next weight rows prefetched, over raw pointers (no array
  conversions per call), on the library's own thread pool, whose threads take chunks of output features first
  come first served and whose caller waits for the chunks, not for the threads (a preempted worker holds up
  nothing);
- portable (`rows_gemm_parallel` / `rows_gemm_serial`): numba, each weight row times up to eight input rows held in
  registers; where no C compiler is.
kernels/cpu_linear.py decides when and which runs; their oracle is `F.linear` (tests/test_cpu_linear.py).
Imports nothing of ours outside kernels/.
"""
from __future__ import annotations

import numba
import numpy as np

from kernels.native_kernels import CHUNKS_PER_THREAD, SOURCES, library as native_library
from kernels.numba_pool import renamed  # also picks the pool numba's parallel kernels run on

_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def _rows_gemm(x, w, out):  # pragma: no cover - only ever compiled
    rows, depth = x.shape
    for n in numba.prange(w.shape[0]):
        wn = w[n]
        m = 0
        while m + 8 <= rows:
            x0, x1, x2, x3, x4, x5, x6, x7 = x[m], x[m + 1], x[m + 2], x[m + 3], x[m + 4], x[m + 5], x[m + 6], x[m + 7]
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
            for k in range(depth):
                wk = wn[k]
                a0 += x0[k] * wk
                a1 += x1[k] * wk
                a2 += x2[k] * wk
                a3 += x3[k] * wk
                a4 += x4[k] * wk
                a5 += x5[k] * wk
                a6 += x6[k] * wk
                a7 += x7[k] * wk
            out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = a0, a1, a2, a3
            out[m + 4, n], out[m + 5, n], out[m + 6, n], out[m + 7, n] = a4, a5, a6, a7
            m += 8
        while m + 4 <= rows:
            x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for k in range(depth):
                wk = wn[k]
                a0 += x0[k] * wk
                a1 += x1[k] * wk
                a2 += x2[k] * wk
                a3 += x3[k] * wk
            out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = a0, a1, a2, a3
            m += 4
        while m < rows:
            xm = x[m]
            a0 = np.float32(0.0)
            for k in range(depth):
                a0 += xm[k] * wn[k]
            out[m, n] = a0
            m += 1


rows_gemm_parallel = numba.njit(parallel=True, cache=True, fastmath=_FASTMATH)(_rows_gemm)
rows_gemm_serial = numba.njit(cache=True, fastmath=_FASTMATH)(renamed(_rows_gemm, "_rows_gemm_serial"))


NATIVE_SOURCE = SOURCES  # the GEMM with the pool (and the attention) it shares
_native = None  # (parallel, serial) once built; False where it cannot be


def native_kernels():
    """(parallel, serial) of the native build, both over `(x_ptr, rows, depth, w_ptr, n_out, out_ptr)`
    (parallel: then the number of threads), or None where it cannot be built (kernels/native_build.py's `why_not`
    says why)."""
    global _native
    if _native is None:
        library = native_library()
        _native = False if library is None else _drive(library)
    return _native or None


def _drive(library):
    gemm, gemm_parallel = library.pagedesk_rows_gemm, library.pagedesk_rows_gemm_parallel

    def parallel(x, rows, depth, w, n_out, out, threads):
        gemm_parallel(x, rows, depth, w, n_out, out, CHUNKS_PER_THREAD, threads)

    def serial(x, rows, depth, w, n_out, out):
        gemm(x, rows, depth, w, n_out, out, 0, n_out)

    return parallel, serial


def warm_up(native: bool = False) -> None:
    """Compile both builds of the kernel that runs: numba's for float32 C-contiguous arrays (from its cache when
    there), or the native build's driver."""
    if not native:
        x, w = np.ones((13, 4), np.float32), np.ones((3, 4), np.float32)
        for kernel in (rows_gemm_parallel, rows_gemm_serial):
            out = np.zeros((13, 3), np.float32)
            kernel(x, w, out)
            assert (out == 4.0).all()
        return
    native = native_kernels()
    if native is not None:
        x, w = np.ones((13, 20), np.float32), np.ones((7, 20), np.float32)
        for run in (lambda *args: native[0](*args, 2), native[1]):
            out = np.zeros((13, 7), np.float32)
            run(x.ctypes.data, 13, 20, w.ctypes.data, 7, out.ctypes.data)
            assert (out == 20.0).all()
