"""Attention kernels over the paged KV cache: Triton for CUDA, plain torch for CPU and as the test oracle.

`get_attention_backend(name)` returns the pair (write_kv_cache, paged_attention) of one backend; every
backend takes the same arguments (see kernels/attention_torch.py for the layout). "torch" is the host path:
the compiled CPU decode kernel (kernels/attention_cpu.py) in front of the torch oracle, which it falls back to
for anything it cannot read (prefill chunks, FP8/bf16 caches, tensors off the CPU); its `step_layout` and
`host_caches` attributes make the host arrays it reads once per step and once per bound cache, passed back as its
`layout` and `caches` keywords (and the torch KV write's `checked`), so a layer does not convert them again.
Quantized linear layers have the same pairing: kernels/quant_torch.py (reference, CPU) and
kernels/triton_quant_linear.py (CUDA).
Imports nothing of ours.
"""
from __future__ import annotations

from typing import Callable

from kernels.attention_torch import paged_attention_torch, write_kv_cache_torch


def get_attention_backend(name: str) -> tuple[Callable, Callable]:
    if name == "torch":
        try:  # decodes on CPU read blocks in place (numba); whatever it cannot read goes to the torch oracle
            from kernels.attention_cpu import paged_attention_cpu
        except ImportError:  # no numba (e.g. a GPU machine's bare environment): the oracle does everything
            return write_kv_cache_torch, paged_attention_torch
        return write_kv_cache_torch, paged_attention_cpu
    if name == "triton":
        from kernels.triton_attention import paged_attention_triton, write_kv_cache_triton
        return write_kv_cache_triton, paged_attention_triton
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
