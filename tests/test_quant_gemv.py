"""The multi-row quantized GEMV, interpreted on CPU: every row count, checkpoint formats, one weight read per call.

TRITON_INTERPRET=1 is set before triton's first import (see tests/interpreted.py). The GEMV holds every row
of a decode batch in one program per (N block, K slice), so the interpreter's loads are counted here: each
packed weight word (or FP8 byte) is loaded by exactly one `tl.load` per call, whatever the row count, and the
number of programs does not grow with the rows. AWQ and GPTQ tensors come from the test packers
(tests/quant_packers.py) through the loader's conversion, as a served checkpoint would.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from interpreted import fresh_process_tests  # noqa: E402
from quant_packers import pack_linear  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from engine.quantization.config import QuantConfig  # noqa: E402
from engine.quantization.methods import IntLinearMethod  # noqa: E402
from kernels.quant_torch import fp8_linear_torch, int_linear_torch, pack_int32  # noqa: E402
from kernels.triton_quant_linear import (GEMV_MAX_ROWS, choose_quant_kernel, quant_gemv_kernel,  # noqa: E402
                                         quant_linear_triton)

IN_INTERPRETER = isinstance(tl.standard.sum, InterpretedFunction) and isinstance(quant_gemv_kernel,
                                                                                  InterpretedFunction)
test_whole_module_in_a_fresh_process, _interpreted_only = fresh_process_tests(__file__, IN_INTERPRETER)


def int_weight(k: int, n: int, bits: int, group: int, act_order: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_groups = -(-k // group)
    g_idx = (torch.randperm(k, generator=gen) % num_groups).to(torch.int32) if act_order else None
    return dict(weight=pack_int32(torch.randint(0, 1 << bits, (k, n), generator=gen), bits, dim=0),
                scales=torch.rand(num_groups, n, generator=gen) * 0.05,
                zeros=torch.randint(0, 1 << bits, (num_groups, n), generator=gen).to(torch.int16), g_idx=g_idx,
                bits=bits, group=group)


def run_int(w: dict, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
    n = w["weight"].shape[1]
    if reference:
        return int_linear_torch(x.float(), w["weight"], w["scales"], w["zeros"], w["bits"], w["group"], w["g_idx"])
    return quant_linear_triton(x, w["weight"], w["scales"], w["zeros"], w["g_idx"], w["bits"], w["group"], n)


def assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = (1e-4 if dtype == torch.float32 else 3e-3) * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_every_row_count_up_to_past_the_gemv_limit():
    """Rows on both sides of every boundary up to GEMV_MAX_ROWS + 1: each row tile (1, 2, 4 on CUDA cores, 16
    and 32 through tl.dot) and the switch to the GEMM; K = 200 is no multiple of the 32-wide K tile and splits
    into partial K slices."""
    w = int_weight(200, 40, 4, 32, act_order=True, seed=1)
    gen = torch.Generator().manual_seed(2)
    kinds = set()
    for rows in (1, 2, 3, 4, 5, 8, 15, 16, 17, GEMV_MAX_ROWS - 1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, 200, generator=gen).to(torch.float16)
        assert_matches(run_int(w, x), run_int(w, x, reference=True), torch.float16)
        choice = choose_quant_kernel(rows)
        kinds.add((choice.name, choice.block_m, choice.use_dot))
        assert (choice.name == "gemv") == (rows <= GEMV_MAX_ROWS) and choice.block_m >= min(rows, 32)
    assert kinds == {("gemv", 1, False), ("gemv", 2, False), ("gemv", 4, False), ("gemv", 16, True),
                     ("gemv", 32, True), ("gemm", 32, True)}


FORMATS = [  # (format, bits, group, symmetric, act order): what AWQ and GPTQ checkpoints ship
    ("awq", 4, 128, False, False), ("awq", 4, 32, False, False), ("gptq", 4, 128, True, True),
    ("gptq", 4, 32, False, False), ("gptq", 8, 128, True, False)]


@pytest.mark.parametrize("fmt,bits,group,sym,act_order", FORMATS,
                         ids=[f"{f}-w{b}-g{g}{'-act' if a else ''}" for f, b, g, _, a in FORMATS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_checkpoint_formats_through_the_loader_conversion(fmt, bits, group, sym, act_order, dtype):
    k, n = 264, 24  # K: two full groups of 128 and a partial one, and not a multiple of the K tile
    float_weight = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    tensors = pack_linear(float_weight, fmt, bits, group, sym, act_order, seed=4)
    method = IntLinearMethod(QuantConfig(fmt, "int", bits, group, symmetric=sym, act_order=act_order,
                                         zero_offset=1 if fmt == "gptq" else 0))
    names = method.names

    def converted(role: str) -> torch.Tensor:
        return method.convert(type("Param", (), {"role": role})(), tensors[names[role]])

    w = dict(weight=converted("qweight"), scales=converted("scales"), zeros=converted("zeros"),
             g_idx=converted("g_idx") if act_order else None, bits=bits, group=group)
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 3, 16, 40):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        expected = run_int(w, x, reference=True)
        assert_matches(run_int(w, x), expected, dtype)
        assert (expected - x.float() @ float_weight.t()).norm() < 0.2 * expected.norm()  # it is the layer


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_fp8_rows(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(40, 200, generator=gen) * 0.3).to(torch.float8_e4m3fn)
    scale = torch.rand(40, generator=gen) + 0.5
    x = torch.randn(rows, 200, generator=gen).to(torch.float16)
    got = quant_linear_triton(x, weight, scale, None, None, 8, 200, 40, weight_fp8=True)
    assert_matches(got, fp8_linear_torch(x.float(), weight, scale), torch.float16)


def test_fp8_block_scales_in_the_gemv_and_the_gemm():
    """Block-wise FP8 (Qwen3-*-FP8's weight_scale_inv, kept per output row and block of 48 columns here so the
    32-wide K tiles straddle blocks and K = 200 ends in a partial one): the CUDA-core GEMV, the tl.dot GEMV and
    the GEMM against the torch dequantization."""
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(40, 200, generator=gen) * 0.3).to(torch.float8_e4m3fn)
    scale = torch.rand(40, 5, generator=gen) + 0.5  # [N, ceil(200 / 48)]
    for rows in (1, 6, 40):
        x = torch.randn(rows, 200, generator=gen).to(torch.float16)
        got = quant_linear_triton(x, weight, scale, None, None, 8, 48, 40, weight_fp8=True)
        assert_matches(got, fp8_linear_torch(x.float(), weight, scale, group_size=48), torch.float16)


class LoadCounter:
    """Counts, per element of one tensor, how many interpreted `tl.load` calls touched it (an address read
    twice by one call is one read: a warp's duplicate addresses are one memory transaction), and the grid."""

    def __init__(self, monkeypatch, tensor: torch.Tensor) -> None:
        self.base, self.itemsize = tensor.data_ptr(), tensor.element_size()
        self.counts = np.zeros(tensor.numel(), dtype=np.int64)
        self.programs = 0
        builder = interpreter.interpreter_builder
        load, set_grid = builder.create_masked_load, builder.set_grid_dim

        def counting_load(ptrs, mask, *args):
            addresses = np.asarray(ptrs.data).astype(np.int64)[np.asarray(mask.data, dtype=bool)]
            index = (addresses - self.base) // self.itemsize
            hit = np.unique(index[(index >= 0) & (index < len(self.counts))])
            self.counts[hit] += 1
            return load(ptrs, mask, *args)

        def counting_grid(x, y, z):
            self.programs += x * y * z
            return set_grid(x, y, z)

        monkeypatch.setattr(builder, "create_masked_load", counting_load)
        monkeypatch.setattr(builder, "set_grid_dim", counting_grid)


@pytest.mark.parametrize("weights", ["w4-act-order", "fp8"])
def test_each_weight_element_is_loaded_once_per_call_whatever_the_rows(monkeypatch, weights):
    k, n = 200, 136  # three N blocks of 64 (the last partial), K slices with a partial K tile
    gen = torch.Generator().manual_seed(6)
    if weights == "fp8":
        w = dict(weight=(torch.randn(n, k, generator=gen) * 0.3).to(torch.float8_e4m3fn),
                 scales=torch.rand(n, generator=gen) + 0.5)
        packed = w["weight"]
    else:
        w = int_weight(k, n, 4, 32, act_order=True, seed=7)
        packed = w["weight"]
    programs = {}
    for rows in (1, 2, 5, 16, GEMV_MAX_ROWS):
        with monkeypatch.context() as patch:
            counter = LoadCounter(patch, packed)
            x = torch.randn(rows, k, generator=gen)
            if weights == "fp8":
                got = quant_linear_triton(x, w["weight"], w["scales"], None, None, 8, k, n, weight_fp8=True)
                expected = fp8_linear_torch(x, w["weight"], w["scales"])
            else:
                got, expected = run_int(w, x), run_int(w, x, reference=True)
        assert_matches(got, expected, torch.float32)
        assert counter.counts.min() == 1 and counter.counts.max() == 1, (rows, np.bincount(counter.counts))
        programs[rows] = counter.programs
    assert all(programs[r] <= programs[1] for r in programs), programs  # the grid never grows with the rows
