"""The compiled CPU forward (--compile-cpu-forward, engine/worker/graphs/cpu_compile.py): the engine's eager steps go
through the compiled forward with every attention layer left to dynamo as an eager call, a compile that fails leaves
them eager with the same output, the flag is refused under tensor parallel, and (only when
`PAGEDESK_COMPILE_CPU_FORWARD=1`: a compile takes about a minute here, which the suite does not pay) greedy output
through the real compile equals HF's. The oracle suites run compiled with that variable set (passed on this branch):
`PAGEDESK_COMPILE_CPU_FORWARD=1 pytest tests/test_engine_parity.py tests/test_hybrid_families.py
tests/test_moe_families.py -k "matches_hf or family_matches"`.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config.flags import EngineConfig
from engine.layers.attention import PagedAttention
from engine.worker.graphs import cpu_compile
from kernels import cpu_decoder
from hf_reference import MAX_TOKENS, engine_greedy


def test_steps_run_through_the_compiled_forward_with_attention_eager(llama_dir, monkeypatch):
    compiled_calls, attention_calls = [], []

    compiling = []

    def fake_compile(fn, dynamic):  # stands in for torch.compile: records the calls, runs them as they are, with
        assert dynamic              # torch.compiler.is_compiling() true as it is while dynamo traces them

        def traced(*args):
            compiled_calls.append(len(args[0]))
            compiling.append(True)
            try:
                return fn(*args)
            finally:
                compiling.pop()
        return traced

    def fake_disable(fn, recursive):
        assert recursive
        return lambda *args, **kwargs: attention_calls.append(1) or fn(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: bool(compiling))
    one_calls = []
    run = cpu_decoder.DecoderLayers.__call__
    monkeypatch.setattr(cpu_decoder.DecoderLayers, "__call__", lambda self, *a: one_calls.append(1) or run(self, *a))

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "disable", fake_disable)
    monkeypatch.delenv(cpu_compile.ENV, raising=False)
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = ["The quick brown fox", "def main():"]
    eager = LLM(str(llama_dir), device="cpu")
    assert eager.engine.runner.dispatch.compiled is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert not compiled_calls and not attention_calls
    llm = LLM(str(llama_dir), device="cpu", compile_cpu_forward=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    num_layers = sum(isinstance(m, PagedAttention) for m in llm.engine.runner.model.modules())
    assert compiled_calls and len(attention_calls) == num_layers * len(compiled_calls)
    # The decode steps ran their layers as one native call, eager: the compiled forward saw the prefills only.
    assert compiled_calls == [13] and one_calls


def test_without_the_one_call_every_step_runs_compiled(llama_dir, monkeypatch):
    """`--cpu-linear numba`: no native one-call decode, so the decode steps go through the compiled forward too."""
    compiled_calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic: lambda *args: compiled_calls.append(len(args[0])) or fn(
        *args))
    monkeypatch.setattr(torch.compiler, "disable", lambda fn, recursive: fn)
    llm = LLM(str(llama_dir), device="cpu", compile_cpu_forward=True, cpu_linear="numba")
    llm.generate(["The quick brown fox", "def main():"], SamplingParams(temperature=0, max_tokens=6))
    assert compiled_calls[0] == 13 and compiled_calls[1:] == [2] * 5


def test_a_failed_compile_leaves_the_steps_eager(llama_dir, monkeypatch, caplog):
    calls = []

    def broken(*args):  # as a compile fails at the first call of the compiled function
        calls.append(1)
        raise RuntimeError("C++ compile failed: no compiler\n(more lines)")

    monkeypatch.setattr(torch, "compile", lambda fn, dynamic: broken)
    monkeypatch.delenv(cpu_compile.ENV, raising=False)
    params = SamplingParams(temperature=0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in LLM(str(llama_dir), device="cpu").generate(["The quick"], params)]
    llm = LLM(str(llama_dir), device="cpu", compile_cpu_forward=True)
    with caplog.at_level("WARNING", logger="pagedesk.engine"):
        assert [o.outputs[0].token_ids for o in llm.generate(["The quick"], params)] == want
    assert len(calls) == 1 and llm.engine.runner.dispatch.compiled.compiled is None
    assert "steps run eager from now on: C++ compile failed: no compiler" in caplog.text


def test_refused_under_tensor_parallel():
    with pytest.raises(ValueError, match="compile-cpu-forward"):
        EngineConfig(model="x", compile_cpu_forward=True, tensor_parallel_size=2).validate()


@pytest.mark.skipif(not cpu_compile.wanted(False), reason=f"compiles for about a minute: set {cpu_compile.ENV}=1")
def test_compiled_greedy_matches_hf(reference):
    path, prompts, expected = reference("llama")
    assert engine_greedy(path, prompts, MAX_TOKENS, compile_cpu_forward=True) == expected
    # With async scheduling the compiled forward reads input ids the last step wrote on the device.
    assert engine_greedy(path, prompts, MAX_TOKENS, compile_cpu_forward=True, async_scheduling=True) == expected
