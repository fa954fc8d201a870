"""Attention kernels over the paged KV cache: Triton for CUDA, plain torch for CPU and as the test oracle.

`get_attention_backend(name)` returns the pair (write_kv_cache, paged_attention) of one backend; every
backend takes the same arguments (see kernels/attention_torch.py for the layout). Quantized linear layers
have the same pairing: kernels/quant_torch.py (reference, CPU) and kernels/triton_quant_linear.py (CUDA).
Imports nothing of ours.
"""
from __future__ import annotations

from typing import Callable

from kernels.attention_torch import paged_attention_torch, write_kv_cache_torch


def get_attention_backend(name: str) -> tuple[Callable, Callable]:
    if name == "torch":
        return write_kv_cache_torch, paged_attention_torch
    if name == "triton":
        from kernels.triton_attention import paged_attention_triton, write_kv_cache_triton
        return write_kv_cache_triton, paged_attention_triton
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
