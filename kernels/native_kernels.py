"""The native library of a CPU decode step's parallel kernels: the row GEMM of the linears (kernels/rows_gemm.c), the
float32 paged decode attention (kernels/decode_attention.c), the thread pool both run on (kernels/native_pool.c)
a Llama-style decoder's layers in one call (kernels/decoder_layers.c, over those and the small ops of
kernels/host_ops.c) and the GEMM of GGUF blocks (kernels/gguf_gemm.c), built as one library by
kernels/native_build.py so the process has one pool. Its users: kernels/cpu_rows_gemm.py, kernels/attention_cpu.py,
kernels/cpu_decoder.py and kernels/gguf_cpu.py. Neither numba nor torch: the engine
sets `set_attention` on machines without numba too. Imports nothing of ours outside kernels/.
"""
from __future__ import annotations

from pathlib import Path

from kernels.native_build import FLOAT, POINTER, SIZE, load

_HERE = Path(__file__).parent
SOURCES = (_HERE / "rows_gemm.c", _HERE / "decode_attention.c", _HERE / "native_pool.c", _HERE / "host_ops.c",
           _HERE / "decoder_layers.c", _HERE / "gguf_gemm.c")
_P, _N, _F = POINTER, SIZE, FLOAT
FUNCTIONS = {
    "pagedesk_rows_gemm": [_P, _N, _N, _P, _N, _P, _N, _N],
    "pagedesk_rows_gemm_parallel": [_P, _N, _N, _P, _N, _P, _N, _N],
    # q, its row stride, k_cache, v_cache, heads, kv heads, head dim, block size, the caches' block, token and head
    # strides, tables, table width, seq lens, rows, sequences, scale, window, soft cap, sinks, heads per item, out,
    # the new keys and values (or NULL), their row stride, their slots, threads
    "pagedesk_decode_attention": [_P, _N, _P, _P, _N, _N, _N, _N, _N, _N, _N, _P, _N, _P, _P, _N, _F, _N, _F, _P, _N,
                                  _P, _P, _P, _N, _P, _N],
    # the model's spec, rows, x, residual, scratch, the step, threads
    "pagedesk_decoder_layers": [_P, _N, _P, _P, _P, _P, _N],
    # ggml type, x, rows, depth, blocks, row bytes, output features, out, its row stride, chunks per thread, threads
    "pagedesk_gguf_gemm": [_N, _P, _N, _N, _P, _N, _N, _P, _N, _N, _N],
}


CHUNKS_PER_THREAD = 8  # chunks a parallel GEMM's features are cut into, per thread, taken first come first served
_attention = True  # whether float32 decode attention takes this library's kernel (the engine's --cpu-linear rows)


def set_attention(on: bool) -> None:
    """Float32 CPU decode attention through this library's kernel (True) or numba's (kernels/attention_cpu.py)."""
    global _attention
    _attention = on


def attention_enabled() -> bool:
    return _attention


def library():
    """The loaded library (once per process), or None where it cannot be built (native_build.why_not says why)."""
    return load(SOURCES, FUNCTIONS)
