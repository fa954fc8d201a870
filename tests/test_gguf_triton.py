"""The Triton GGUF kernels, interpreted on CPU, against the torch reference per block format.

TRITON_INTERPRET=1 is set before triton's first import (tests/interpreted.py). Weights are random blocks of each
format (tests/gguf_blocks.py); the GEMV (decode rows on CUDA cores and through tl.dot) and the GEMM (prefill) must
give what dequantize-then-matmul gives (kernels/gguf_torch.py), in float32 and float16 (bf16 `tl.dot` is wrong
in the interpreter). N is no multiple of the N tile, K spans several blocks and splits into K slices.
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

from kernels.gguf_torch import BLOCK_FORMATS, gguf_linear_torch  # noqa: E402
from kernels.triton_gguf import gguf_gemv_kernel, gguf_linear_triton  # noqa: E402
from kernels.triton_quant_linear import QuantKernel  # noqa: E402

IN_INTERPRETER = isinstance(tl.standard.sum, InterpretedFunction) and isinstance(gguf_gemv_kernel, InterpretedFunction)
test_whole_module_in_a_fresh_process, _interpreted_only = fresh_process_tests(__file__, IN_INTERPRETER)


def weight(name: str, n: int, k: int) -> torch.Tensor:
    fmt = BLOCK_FORMATS[FORMAT_IDS[name]]
    blocks = random_blocks(name, n * k // fmt.block_size, seed=FORMAT_IDS[name])
    return torch.from_numpy(blocks).reshape(n, -1)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("rows, kernel", [(1, None), (3, None), (6, None), (40, None),
                                          (2, QuantKernel("gemm", 32, True))])
def test_kernels_match_the_reference(name, rows, kernel):
    n, k = 24, 512
    w = weight(name, n, k)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        expected = gguf_linear_torch(x.float(), w, FORMAT_IDS[name])
        got = gguf_linear_triton(x, w, FORMAT_IDS[name], kernel=kernel)
        assert got.shape == (rows, n) and got.dtype == dtype
        tol = (2e-4 if dtype == torch.float32 else 4e-3) * max(1.0, expected.abs().max().item())
        torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_bias_and_leading_dims():
    w = weight("Q4_K", 8, 256)
    x = torch.randn(2, 3, 256)
    bias = torch.randn(8)
    expected = gguf_linear_torch(x, w, FORMAT_IDS["Q4_K"], bias)
    torch.testing.assert_close(gguf_linear_triton(x, w, FORMAT_IDS["Q4_K"], bias), expected, atol=1e-3, rtol=1e-3)


def test_a_weight_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="does not hold rows of 512 weights"):
        gguf_linear_triton(torch.randn(1, 512), weight("Q8_0", 4, 256), FORMAT_IDS["Q8_0"])


def test_the_gpu_benchmark_runs_interpreted(capsys):
    """`python -m kernels.bench_gguf --smoke`: every format through both kernels, checked against the reference."""
    from kernels.bench_gguf import TYPES, main
    assert main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert all(f"| {name} | 33 | gemm" in out for name in TYPES) and "MISMATCH" not in out
