"""Quantized-linear Triton kernels against the torch reference, run on CPU by the Triton interpreter.

TRITON_INTERPRET=1 is set before triton's first import (see tests/test_kernels_triton.py for why); if triton
was imported compiled earlier in this process the module reruns itself in a subprocess. Odd shapes on
purpose: K not a multiple of the K tile, N of 8 and N not a multiple of the N tile, group size -1 and 32,
act order, 4- and 8-bit codes and FP8 bytes; 1-20 rows take the split-K GEMV (1 and 3 on CUDA cores, 6 and
20 through tl.dot), 40 rows the tl.dot GEMM (tests/test_quant_gemv.py covers every row tile and the reads).
Also the FP8 W8A8 path (torch._scaled_mm, what sm_89+ cards run) against weight-only FP8.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from interpreted import fresh_process_tests  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels.quant_torch import fp8_linear_torch, fp8_w8a8_linear, int_linear_torch, pack_int32  # noqa: E402
from kernels.triton_quant_linear import quant_gemm_kernel, quant_linear_triton  # noqa: E402

IN_INTERPRETER = isinstance(tl.standard.sum, InterpretedFunction) and isinstance(quant_gemm_kernel,
                                                                                  InterpretedFunction)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3}
WEIGHTS = [  # (bits or "fp8", group size, act order)
    (4, 32, False), (4, -1, False), (8, 32, False), (4, 32, True), (8, -1, True), ("fp8", -1, False)]
SHAPES = [(72, 8), (40, 72)]  # (K, N)


test_whole_module_in_a_fresh_process, _interpreted_only = fresh_process_tests(__file__, IN_INTERPRETER)


def packed_weight(k: int, n: int, bits, group: int, act_order: bool, gen: torch.Generator):
    if bits == "fp8":
        weight = (torch.randn(n, k, generator=gen) * 0.3).to(torch.float8_e4m3fn)
        return dict(weight=weight, scales=torch.rand(n, generator=gen) + 0.5, zeros=None, g_idx=None)
    size = k if group == -1 else group
    num_groups = -(-k // size)
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen)
    g_idx = torch.randperm(k, generator=gen) % num_groups if act_order else None
    return dict(weight=pack_int32(codes, bits, dim=0), scales=torch.rand(num_groups, n, generator=gen) * 0.05,
                zeros=torch.randint(0, 1 << bits, (num_groups, n), generator=gen).to(torch.int16),
                g_idx=None if g_idx is None else g_idx.to(torch.int32))


@pytest.mark.parametrize("bits,group,act_order", WEIGHTS,
                         ids=[f"w{b}-g{g}{'-act' if a else ''}" for b, g, a in WEIGHTS])
@pytest.mark.parametrize("k,n", SHAPES, ids=[f"k{k}-n{n}" for k, n in SHAPES])
@pytest.mark.parametrize("rows", [1, 3, 6, 20, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_quant_linear_matches_torch_reference(bits, group, act_order, k, n, rows, dtype):
    gen = torch.Generator().manual_seed(k * 1000 + n + rows)
    w = packed_weight(k, n, bits, group, act_order, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    if bits == "fp8":
        expected = fp8_linear_torch(x.float(), w["weight"], w["scales"], bias.float())
        got = quant_linear_triton(x, w["weight"], w["scales"], None, None, 8, k, n, weight_fp8=True, bias=bias)
    else:
        size = k if group == -1 else group
        expected = int_linear_torch(x.float(), w["weight"], w["scales"], w["zeros"], bits, size, w["g_idx"],
                                    bias.float())
        got = quant_linear_triton(x, w["weight"], w["scales"], w["zeros"], w["g_idx"], bits, size, n, bias=bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=TOLERANCE[dtype])


def test_fp8_w8a8_close_to_weight_only():
    """Dynamic per-token FP8 activations with FP8 weights: within FP8 rounding of the weight-only result."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(48, 64, generator=gen) * 0.3).to(torch.float8_e4m3fn)
    scale = torch.rand(48, generator=gen) + 0.5
    x = torch.randn(5, 64, generator=gen)
    expected = fp8_linear_torch(x, weight, scale)
    got = fp8_w8a8_linear(x, weight, scale)
    assert (got - expected).norm() / expected.norm() < 0.05
