"""The CPU row kernels for decode-sized float32 linears (kernels/cpu_linear.py, kernels/cpu_rows_gemm.py: numba's and
the native build of kernels/rows_gemm.c) against their oracle `F.linear`, what they hand back to `F.linear`, the
native build's cache and fallbacks (kernels/native_build.py), and `--cpu-linear` reaching the engine."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels import cpu_linear, cpu_rows_gemm, native_build
from kernels.cpu_rows_gemm import rows_gemm_parallel, rows_gemm_serial

NO_NATIVE = "no native build of kernels/rows_gemm.c here: install a C compiler (apt install gcc)"


@pytest.fixture(autouse=True)
def rows_backend(monkeypatch):
    before = cpu_linear.backend()
    cpu_linear.set_backend("rows")
    monkeypatch.setattr(cpu_linear, "_kernels", None)  # loaded afresh by each test
    yield
    cpu_linear.set_backend(before)


def use(implementation: str) -> None:
    """The row backend on numba's kernel or the native build (skipped where it cannot be built)."""
    cpu_linear.set_backend("numba" if implementation == "numba" else "rows")
    if cpu_linear.implementation() != implementation:
        pytest.skip(NO_NATIVE)


def calls_of(monkeypatch) -> list[str]:
    """Which build ran, per call (the kernels are wrapped where cpu_linear looks them up)."""
    seen = []
    cpu_linear._load_kernels()
    parallel, serial, threads, native = cpu_linear._kernels

    def tag(name, kernel):
        def run(*args):
            seen.append(name)
            return kernel(*args)
        return run
    monkeypatch.setattr(cpu_linear, "_kernels", (tag("parallel", parallel), tag("serial", serial), threads, native))
    return seen


# Every tile of both kernels (numba's 8, 4 and single rows; the native 4, 2 and single rows by 3 or single weight
# rows) and their mixes, serial and parallel, odd depths (not a multiple of the 8-wide vectors) and widths.
@pytest.mark.parametrize("implementation, rows", [
    (implementation, rows)
    for implementation, limit in [("numba", cpu_linear.MAX_ROWS), ("native", cpu_linear.NATIVE_MAX_ROWS)]
    for rows in [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 15, 16, 17, 31, 32] if rows <= limit])
@pytest.mark.parametrize("shape", [(37, 19), (640, 512), (1001, 133)])  # (out, in): serial by size, then parallel
def test_rows_match_f_linear(implementation, rows, shape, monkeypatch):
    use(implementation)
    torch.manual_seed(rows)
    x, w = torch.randn(rows, shape[1]), torch.randn(*shape)
    seen = calls_of(monkeypatch)
    got = cpu_linear.linear(x, w)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-4)
    work = rows * shape[0] * shape[1]
    wanted = "parallel" if work >= cpu_linear.PARALLEL_MIN_WORK and cpu_linear._kernels[2] > 1 else "serial"
    assert seen == [wanted]


def native_or_skip():
    native = cpu_rows_gemm.native_kernels()
    if native is None:
        pytest.skip(NO_NATIVE)
    return native


def test_native_chunks_cover_every_output_feature():
    """The parallel driver's chunks (multiples of the tile's weight rows, taken from a shared counter) leave no
    feature out and none twice, for more threads than chunks too."""
    native = native_or_skip()
    torch.manual_seed(3)
    for n_out, threads in [(1, 8), (5, 8), (37, 4), (38, 3), (640, 16), (1001, 2)]:
        x, w = torch.randn(3, 24), torch.randn(n_out, 24)
        out = torch.full((3, n_out), float("nan"))
        native[0](x.data_ptr(), 3, 24, w.data_ptr(), n_out, out.data_ptr(), threads)
        torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_native_pool_runs_jobs_back_to_back():
    """The pool's jobs one after another, as a step's linears come (its workers spinning or asleep between them,
    a late one finding the job done): every result whole, whatever the sizes and thread counts before it."""
    parallel = native_or_skip()[0]
    generator = torch.Generator().manual_seed(4)
    for call in range(300):
        rows = int(torch.randint(1, 9, (1,), generator=generator))
        n_out = int(torch.randint(1, 700, (1,), generator=generator))
        x, w = torch.randn(rows, 40, generator=generator), torch.randn(n_out, 40, generator=generator)
        out = torch.full((rows, n_out), float("nan"))
        parallel(x.data_ptr(), rows, 40, w.data_ptr(), n_out, out.data_ptr(), 2 + call % 3)
        torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-4)


def _forked_child_gemm(x, w, expected, ok) -> None:
    # Only the kernel and a small compare: a forked child of a process whose OpenMP pools ran must not start them.
    out = torch.empty(expected.shape)
    cpu_rows_gemm.native_kernels()[0](x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.shape[0], out.data_ptr(), 2)
    ok.value = bool((out - expected).abs().max() < 1e-4)


def test_native_pool_works_in_a_forked_child():
    """A child forked after the parent's pool started has none of its workers: it starts its own (no hang)."""
    import multiprocessing

    parallel = native_or_skip()[0]
    x, w, out = torch.randn(2, 64), torch.randn(999, 64), torch.empty(2, 999)
    parallel(x.data_ptr(), 2, 64, w.data_ptr(), 999, out.data_ptr(), 2)
    context = multiprocessing.get_context("fork")
    ok = context.Value("b", False)
    child = context.Process(target=_forked_child_gemm, args=(x, w, F.linear(x, w), ok))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0 and ok.value


FAKE_CC = "#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake-cc 1.0; exit 0; fi\n" \
          "echo 'error: no such thing' >&2\nexit 1\n"


def test_native_build_is_cached_per_source_compiler_and_cpu(tmp_path, monkeypatch):
    compiler = native_build.find_compiler()
    if compiler is None:
        pytest.skip(NO_NATIVE)
    monkeypatch.setenv("PAGEDESK_KERNEL_CACHE", str(tmp_path))
    built = native_build.build(cpu_rows_gemm.NATIVE_SOURCE, compiler)
    assert built.parent == tmp_path and built.is_file()
    stamp = built.stat().st_mtime_ns
    assert native_build.build(cpu_rows_gemm.NATIVE_SOURCE, compiler) == built  # found, not built again
    assert built.stat().st_mtime_ns == stamp
    monkeypatch.setattr(native_build, "cpu_features", lambda: "flags : another cpu")
    assert native_build.build(cpu_rows_gemm.NATIVE_SOURCE, compiler) != built  # never run on a CPU it was not for
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial file left


@pytest.mark.parametrize("compiler", ["none", "failing"])
def test_rows_fall_back_to_numba_without_a_native_build(compiler, tmp_path, monkeypatch):
    """No C compiler, or one that fails: the row backend runs numba's kernel, the reason kept, results equal."""
    monkeypatch.setenv("PAGEDESK_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(native_build, "why_not", {})
    monkeypatch.setattr(cpu_rows_gemm, "_native", None)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CC", raising=False)
    if compiler == "failing":
        fake = bin_dir / "cc"
        fake.write_text(FAKE_CC)
        fake.chmod(0o755)
    cpu_linear.set_backend("rows")
    assert cpu_linear.implementation() == "numba"
    reason = native_build.why_not["rows_gemm.c"]
    assert ("no C compiler" in reason) if compiler == "none" else ("no such thing" in reason)
    x, w = torch.randn(5, 40), torch.randn(30, 40)
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)


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


def test_a_layer_weight_parameter_is_read_in_place(monkeypatch):
    """Model weights are nn.Parameters: the kernel reads them (a fake tensor inside one it would not)."""
    seen = calls_of(monkeypatch)
    w = torch.nn.Parameter(torch.randn(24, 16), requires_grad=False)
    x = torch.randn(3, 16)
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert seen


def test_no_rows():
    out = cpu_linear.linear(torch.empty(0, 8), torch.randn(5, 8), torch.randn(5))
    assert out.shape == (0, 5)


@pytest.mark.parametrize("case", ["numba: 17 rows", "native: 33 rows", "bfloat16", "strided weight", "grad",
                                  "torch backend"])
def test_everything_else_is_f_linear(case, monkeypatch):
    torch.manual_seed(2)
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    if case == "numba: 17 rows":
        use("numba")
        x = torch.randn(cpu_linear.MAX_ROWS + 1, 16)
    elif case == "native: 33 rows":
        use("native")
        x = torch.randn(cpu_linear.NATIVE_MAX_ROWS + 1, 16)
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


def test_switching_backends_takes_the_new_kernel_s_row_limit_at_once():
    """A 32-row linear right after switching to the native build runs there, not on numba's 16-row limit."""
    cpu_linear.set_backend("numba")
    cpu_linear.set_backend("rows")
    taken = cpu_linear._rows_ok(torch.randn(32, 8), torch.randn(4, 8))  # before anything else loads the kernels
    if cpu_linear.implementation() != "native":
        pytest.skip(NO_NATIVE)
    assert taken


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="rows, numba, torch"):
        cpu_linear.set_backend("mkl")


@pytest.mark.parametrize("choice", ["rows", "numba", "torch"])
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
