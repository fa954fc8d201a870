"""The native GEMM over GGUF blocks of a CPU decode batch (kernels/gguf_cpu.py, kernels/gguf_gemm.c) against the
torch path that dequantizes (kernels/gguf_torch.py), where it hands back to that path, and a GGUF model's greedy ids
through it."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_linear, gguf_cpu, native_kernels
from kernels.bench_gguf import random_blocks
from kernels.gguf_torch import gguf_linear_torch

NAMES = {2: "Q4_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS"}


@pytest.fixture(autouse=True)
def native():
    cpu_linear.set_backend("rows")
    if native_kernels.library() is None:
        pytest.skip("no native build of the CPU kernels here: install a C compiler (apt install gcc)")


@pytest.mark.parametrize("ggml_type", list(NAMES))
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_matches_the_dequantizing_torch_path(ggml_type, rows):
    """Random codes under finite scales, 512 inputs (2 Q4_K / Q6_K super-blocks, 16 Q8_0 blocks) to 67 outputs (an odd
    count over the pool's chunks), batch 1 to the row limit."""
    torch.manual_seed(ggml_type * 100 + rows)
    _, weight = random_blocks(NAMES[ggml_type], 67, 512, torch.device("cpu"))
    x = torch.randn(rows, 512)
    got = gguf_cpu.gguf_linear(x, weight, ggml_type)
    want = gguf_linear_torch(x, weight, ggml_type)
    assert got is not None and got.shape == (rows, 67)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("case", ["MXFP4", "prefill-sized", "bfloat16", "torch backend"])
def test_everything_else_is_left_to_torch(case):
    torch.manual_seed(7)
    cpu = torch.device("cpu")
    (ggml_type, weight), x = random_blocks("Q4_K", 8, 256, cpu), torch.randn(2, 256)
    if case == "MXFP4":
        ggml_type, weight = random_blocks("MXFP4", 8, 256, cpu)
    elif case == "prefill-sized":
        x = torch.randn(gguf_cpu.MAX_ROWS + 1, 256)
    elif case == "bfloat16":
        x = x.bfloat16()
    else:
        cpu_linear.set_backend("torch")
    try:
        assert gguf_cpu.gguf_linear(x, weight, ggml_type) is None
    finally:
        cpu_linear.set_backend("rows")


@pytest.mark.parametrize("arch,quant", [("llama", "Q4_0"), ("llama", "Q8_0"), ("llama", "Q4_K"), ("llama", "Q5_K"),
                                        ("llama", "Q6_K"), ("llama", "IQ4_NL"), ("qwen3_moe", "Q4_K")])
def test_a_gguf_model_decodes_through_it_with_the_torch_paths_ids(tmp_path, arch, quant, monkeypatch):
    """Greedy ids of a GGUF model with the native GEMM (the default backend) and with numba's backend (the torch
    path for every GGUF linear): the same, and the decode steps' linears, its LM head (untied) and a MoE model's
    experts went through the native GEMM."""
    from gguf_files import make_tiny_gguf

    import engine.layers.embedding as embedding
    import engine.quantization.gguf.method as method
    import kernels.moe_torch as moe_torch
    from engine import LLM, SamplingParams
    from hf_reference import make_prompts

    path = make_tiny_gguf(tmp_path, arch, quant, big=True, initializer_range=0.2, tie_word_embeddings=False)
    prompts, params = make_prompts(400)[:3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls = {}

    def counted(where):
        def run(*args):
            out = gguf_cpu.gguf_linear(*args)
            calls.setdefault(where, []).append(out is not None)
            return out
        return run

    for where, module in (("linears", method), ("lm head", embedding), ("experts", moe_torch)):
        monkeypatch.setattr(module, "gguf_linear", counted(where))
    runs = {}
    for backend in ("rows", "numba"):
        llm = LLM(str(path), device="cpu", max_model_len=256, cpu_linear=backend)
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * 3, use_tqdm=False)]
        if backend == "rows":
            assert any(calls["linears"]) and any(calls["lm head"]) and (arch != "qwen3_moe" or any(calls["experts"]))
    cpu_linear.set_backend("rows")
    assert runs["rows"] == runs["numba"]


def test_every_finite_half_scale_reads_exactly():
    """The block scales are IEEE halves read from their bits (kernels/gguf_gemm.c's f16): every finite one, the
    subnormals and the largest included, as a Q8_0 block of codes 1 against a row of ones (32 x scale, exact)."""
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    halves = halves[torch.isfinite(halves)]
    blocks = torch.ones(len(halves), 34, dtype=torch.uint8)
    blocks[:, :2] = halves.view(torch.uint8).view(-1, 2)
    got = gguf_cpu.gguf_linear(torch.ones(1, 32), blocks, 8)
    assert got is not None and torch.equal(got[0], 32 * halves.float())
