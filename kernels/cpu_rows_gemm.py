"""A float32 GEMM for a few rows on the CPU that reads each weight row once (numba).

`out[m, n] = sum_k x[m, k] * w[n, k]`, w in torch's [out, in] layout. Parallel over output features; each
weight row is multiplied by up to eight input rows at a time, their sums in registers, so a decode step's
weights stream from memory once per eight sequences with no packing pass (the BLAS GEMMs' first pass over the
weights). kernels/cpu_linear.py decides when it runs; its oracle is `F.linear` (tests/test_cpu_linear.py).
Imports nothing of ours outside kernels/.
"""
from __future__ import annotations

import numba
import numpy as np

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


def warm_up() -> None:
    """Compile (or load from numba's cache) both builds for float32 C-contiguous arrays."""
    x, w = np.ones((13, 4), np.float32), np.ones((3, 4), np.float32)
    for kernel in (rows_gemm_parallel, rows_gemm_serial):
        out = np.zeros((13, 3), np.float32)
        kernel(x, w, out)
        assert (out == 4.0).all()
