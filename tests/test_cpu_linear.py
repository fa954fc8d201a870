"""The CPU row kernel for decode-sized float32 linears (kernels/cpu_linear.py, kernels/cpu_rows_gemm.py) against
its oracle `F.linear`, what it hands back to `F.linear`, and `--cpu-linear` reaching the engine."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels import cpu_linear
from kernels.cpu_rows_gemm import rows_gemm_parallel, rows_gemm_serial


@pytest.fixture(autouse=True)
def rows_backend():
    before = cpu_linear.backend()
    cpu_linear.set_backend("rows")
    yield
    cpu_linear.set_backend(before)


def calls_of(monkeypatch) -> list[str]:
    """Which build ran, per call (the kernels are wrapped where cpu_linear looks them up)."""
    seen = []
    cpu_linear._load_kernels()
    parallel, serial, threads = cpu_linear._kernels

    def tag(name, kernel):
        def run(*args):
            seen.append(name)
            return kernel(*args)
        return run
    monkeypatch.setattr(cpu_linear, "_kernels", (tag("parallel", parallel), tag("serial", serial), threads))
    return seen


# Every tile of the kernel (8, 4 and single rows, and their mixes) on both builds, odd depths and widths.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 15, 16])
@pytest.mark.parametrize("shape", [(37, 19), (640, 512)])  # (out, in): serial by size, then parallel
def test_rows_match_f_linear(rows, shape, monkeypatch):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, shape[1]), torch.randn(*shape)
    seen = calls_of(monkeypatch)
    got = cpu_linear.linear(x, w)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-4)
    work = rows * shape[0] * shape[1]
    wanted = "parallel" if work >= cpu_linear.PARALLEL_MIN_WORK and cpu_linear._kernels[2]() > 1 else "serial"
    assert seen == [wanted]


@pytest.mark.parametrize("kernel", [rows_gemm_parallel, rows_gemm_serial])
def test_both_builds_match(kernel):
    torch.manual_seed(0)
    x, w = torch.randn(11, 70), torch.randn(33, 70)
    out = torch.full((11, 33), float("nan"))
    kernel(x.numpy(), w.numpy(), out.numpy())
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


def test_bias_leading_dims_and_strided_input(monkeypatch):
    torch.manual_seed(1)
    w, b = torch.randn(24, 16), torch.randn(24)
    x = torch.randn(2, 3, 32)[..., ::2]  # [2, 3, 16], not contiguous
    seen = calls_of(monkeypatch)
    got = cpu_linear.linear(x, w, b)
    assert got.shape == (2, 3, 24) and seen
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_no_rows():
    out = cpu_linear.linear(torch.empty(0, 8), torch.randn(5, 8), torch.randn(5))
    assert out.shape == (0, 5)


@pytest.mark.parametrize("case", ["17 rows", "bfloat16", "strided weight", "grad", "torch backend"])
def test_everything_else_is_f_linear(case, monkeypatch):
    torch.manual_seed(2)
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    if case == "17 rows":
        x = torch.randn(cpu_linear.MAX_ROWS + 1, 16)
    elif case == "bfloat16":
        x, w = x.bfloat16(), w.bfloat16()
    elif case == "strided weight":
        w = torch.randn(16, 8).T
    elif case == "grad":
        w.requires_grad_(True)
    else:
        cpu_linear.set_backend("torch")
    seen = calls_of(monkeypatch)
    got = cpu_linear.linear(x, w)
    assert seen == []
    assert torch.equal(got, F.linear(x, w))


def test_fake_tensors_never_reach_numba(monkeypatch):
    seen = calls_of(monkeypatch)
    with FakeTensorMode():
        out = cpu_linear.linear(torch.empty(2, 16), torch.empty(8, 16))
    assert out.shape == (2, 8) and seen == []


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="rows, torch"):
        cpu_linear.set_backend("mkl")


@pytest.mark.parametrize("choice", ["rows", "torch"])
def test_flag_reaches_the_engine_and_both_give_hf_greedy(choice, reference):
    from hf_reference import MAX_TOKENS, engine_greedy

    path, prompts, expected = reference("llama")
    assert engine_greedy(path, prompts, MAX_TOKENS, max_model_len=512, cpu_linear=choice) == expected
    assert cpu_linear.backend() == choice


def test_bench_prints_a_row_per_batch(capsys):
    from kernels.bench_cpu_linear import main
    main(["--hidden", "32", "--layers", "1", "--vocab", "64", "--rows", "1", "3", "--cache-mib", "0",
          "--repeats", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in lines[1:]] == ["1", "3"]
    assert all(line.rstrip().endswith("x |") for line in lines[1:])
