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
from kernels.gguf_torch import block_format, row_bytes
from kernels.host_gate import eager_cpu_float32
from kernels.native_kernels import CHUNKS_PER_THREAD, library

NATIVE_TYPES = frozenset({2, 8, 12, 13, 14, 20, 23})  # the ggml types kernels/gguf_gemm.c decodes (names above)
MAX_ROWS = cpu_linear.NATIVE_MAX_ROWS  # a decode batch; a prefill chunk dequantizes once and takes the BLAS


def decodes(ggml_type: int, depth: int) -> bool:
    """Whether the native GEMM decodes rows of `depth` weights of this type (whole blocks of a type it knows)."""
    return ggml_type in NATIVE_TYPES and depth % block_format(ggml_type).block_size == 0


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int) -> torch.Tensor | None:
    """x [..., K] @ W.T for GGUF blocks `weight` [N, K / block * type size] (uint8), or None."""
    depth = x.shape[-1]
    if not decodes(ggml_type, depth) or not eager_cpu_float32(x) or weight.dtype != torch.uint8 or not weight.is_cpu \
            or weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] != row_bytes(ggml_type, depth) \
            or cpu_linear.implementation() != "native":
        return None
    rows = x.reshape(-1, depth)
    native = library()
    if not 0 < rows.shape[0] <= MAX_ROWS or native is None:
        return None
    rows = rows.contiguous()
    n_out = weight.shape[0]
    out = torch.empty((rows.shape[0], n_out), dtype=torch.float32)
    threads = cpu_linear.threads() if rows.shape[0] * n_out * depth >= cpu_linear.PARALLEL_MIN_WORK else 1
    native.pagedesk_gguf_gemm(ggml_type, rows.data_ptr(), rows.shape[0], depth, weight.data_ptr(), weight.shape[1],
                              n_out, out.data_ptr(), n_out, CHUNKS_PER_THREAD, threads)
    return out.view(*x.shape[:-1], n_out)
