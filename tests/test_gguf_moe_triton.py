"""GGUF experts through the Triton fused-MoE kernel, interpreted on CPU, against the torch reference loop.

TRITON_INTERPRET=1 before triton's first import (tests/interpreted.py). Experts are random blocks of each GGUF
format (tests/gguf_blocks.py) as FusedMoE keeps them (PackedExperts format "gguf": [E, N, row bytes]); rows of one
256-wide super-block for the K-quants, two 32-blocks for the others; decode (a few tokens, fp32 and fp16) for
every format, prefill tiles for two. The reference dequantizes one routed expert at a time (kernels/moe_torch.py).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from gguf_blocks import FORMAT_IDS, QUANTIZED, random_blocks  # noqa: E402
from interpreted import fresh_process_tests  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels.gguf_torch import BLOCK_FORMATS  # noqa: E402
from kernels.moe_torch import PackedExperts, fused_moe_torch  # noqa: E402
from kernels.triton_moe import fused_moe_kernel, fused_moe_triton  # noqa: E402

IN_INTERPRETER = isinstance(tl.standard.sum, InterpretedFunction) and isinstance(fused_moe_kernel, InterpretedFunction)
test_whole_module_in_a_fresh_process, _interpreted_only = fresh_process_tests(__file__, IN_INTERPRETER)


def experts(name: str, e: int, n: int, k: int, seed: int, dtype) -> PackedExperts:
    fmt = BLOCK_FORMATS[FORMAT_IDS[name]]
    blocks = random_blocks(name, e * n * k // fmt.block_size, seed=seed, scale=1e-3)  # fp16 stays in range
    return PackedExperts("gguf", torch.from_numpy(blocks).reshape(e, n, -1), ggml_type=fmt.ggml_type, dtype=dtype)


CASES = [(name, 3) for name in QUANTIZED] + [("Q4_K", 40), ("Q8_0", 40)]  # decode for each format; prefill tiles


@pytest.mark.parametrize("name, tokens", CASES)
def test_gguf_experts_match_the_reference(name, tokens):
    size = BLOCK_FORMATS[FORMAT_IDS[name]].block_size
    e, top_k, hidden, inter = 3, 2, max(64, size), max(64, size)  # K-quants need rows of whole 256-blocks
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    for dtype in (torch.float32, torch.float16) if tokens < 16 else (torch.float16,):
        w13 = experts(name, e, 2 * inter, hidden, 1, dtype)
        w2 = experts(name, e, hidden, inter, 2, dtype)
        assert w13.shape == (e, 2 * inter, hidden) and w2.shape == (e, hidden, inter)
        x = (torch.randn(tokens, hidden, generator=gen) * 0.2).to(dtype)
        expected = fused_moe_torch(x.float(), experts(name, e, 2 * inter, hidden, 1, torch.float32),
                                   experts(name, e, hidden, inter, 2, torch.float32), weights, ids)
        got = fused_moe_triton(x, w13, w2, weights, ids)
        tol = (1e-3 if dtype == torch.float32 else 2e-2) * max(1.0, expected.abs().max().item())
        torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
