"""A decode step's linears over GGUF blocks on the CPU, decoded block by block inside a native GEMM
(kernels/gguf_gemm.c): Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS (a Q4_K_M file is Q4_K and Q6_K, a Q5_K_M
Q5_K and Q6_K), up to `MAX_ROWS` float32 rows; MXFP4 keeps the torch path.

The torch path (kernels/gguf_torch.py `gguf_linear_torch`, the oracle) dequantizes chunks of rows into float
temporaries and multiplies them with F.linear: a Q4_K decode step wrote and read ~7x the bytes of its blocks. Here
each weight block is decoded on the stack and used by every row of the step before the next, on the native
library's thread pool. `gguf_linear` returns None where it does not apply (another type, more rows, no native
build, anything `host_gate.eager_cpu_float32` refuses, `--cpu-linear` other than rows) and the caller runs the torch
path. Results equal it to float32 rounding. Imports nothing of ours outside kernels/.
"""
from __future__ import annotations

import torch

from kernels import cpu_linear
from kernels.host_gate import eager_cpu_float32
from kernels.native_kernels import library

# ggml type id -> values per block and bytes per block: Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS
TYPES = {2: 32, 8: 32, 12: 256, 13: 256, 14: 256, 20: 32, 23: 256}
TYPE_SIZES = {2: 18, 8: 34, 12: 144, 13: 176, 14: 210, 20: 18, 23: 136}
MAX_ROWS = cpu_linear.NATIVE_MAX_ROWS  # a decode batch; a prefill chunk dequantizes once and takes the BLAS


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int) -> torch.Tensor | None:
    """x [..., K] @ W.T for GGUF blocks `weight` [N, K / block * type size] (uint8), or None."""
    values = TYPES.get(ggml_type)
    if values is None or not eager_cpu_float32(x) or weight.dtype != torch.uint8 or not weight.is_cpu \
            or weight.dim() != 2 or not weight.is_contiguous() or cpu_linear.implementation() != "native":
        return None
    depth = x.shape[-1]
    rows = x.reshape(-1, depth)
    if not 0 < rows.shape[0] <= MAX_ROWS or depth % values or weight.shape[1] != depth // values * TYPE_SIZES[
            ggml_type]:
        return None
    native = library()
    if native is None:
        return None
    rows = rows.contiguous()
    n_out = weight.shape[0]
    out = torch.empty((rows.shape[0], n_out), dtype=torch.float32)
    threads = cpu_linear.threads() if rows.shape[0] * n_out * depth >= cpu_linear.PARALLEL_MIN_WORK else 1
    from kernels.cpu_rows_gemm import CHUNKS_PER_THREAD  # numba's module: where the native backend runs only
    native.pagedesk_gguf_gemm(ggml_type, rows.data_ptr(), rows.shape[0], depth, weight.data_ptr(), weight.shape[1],
                              n_out, out.data_ptr(), n_out, CHUNKS_PER_THREAD, threads)
    return out.view(*x.shape[:-1], n_out)
