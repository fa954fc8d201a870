"""The fused host ops of a CPU decode batch (kernels/cpu_host_ops.py, kernels/host_ops.c) against torch's ops, where
they hand back to torch, and the engine's greedy ids with them on and off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.layers.norm import GemmaRMSNorm, RMSNorm
from kernels import cpu_host_ops


@pytest.fixture(autouse=True)
def native():
    cpu_host_ops.set_enabled(True)  # an engine started with --cpu-linear torch in this process turned them off
    if not cpu_host_ops.available():
        pytest.skip("no native build of kernels/host_ops.c here: install a C compiler (apt install gcc)")


@pytest.mark.parametrize("shape", [(1, 512), (8, 19), (3, 2, 40), (0, 16)])
@pytest.mark.parametrize("norm_class", [RMSNorm, GemmaRMSNorm])
def test_norm_with_and_without_residual_matches_torch(shape, norm_class):
    torch.manual_seed(0)
    norm = norm_class(shape[-1], eps=1e-5)
    norm.weight.data.normal_()
    x, residual = torch.randn(shape), torch.randn(shape)
    assert cpu_host_ops.rms_norm(x, norm.weight, norm.eps, residual) is not None  # a parameter is read in place
    alone = norm(x)
    out, total = norm(x, residual)
    cpu_host_ops.set_enabled(False)
    try:
        want_alone = norm(x)
        want_out, want_total = norm(x, residual)
    finally:
        cpu_host_ops.set_enabled(True)
    torch.testing.assert_close(alone, want_alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(total, want_total)  # the add is the add
    assert not x.numel() or total.data_ptr() not in (x.data_ptr(), residual.data_ptr())  # inputs untouched


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 7), (2, 3, 16), (0, 8), (3, 2 * 21)])
def test_silu_mul_matches_torch(shape):
    """Whole vectors of 8 and the rows' last few values; gates far out on both sides (the exp's clamps), NaN."""
    torch.manual_seed(1)
    gate_up = torch.randn(shape) * 4
    if gate_up.numel() and shape[-1] // 2 >= 7:  # the first row's first seven gates
        gate_up.view(-1, shape[-1])[0, :7] = torch.tensor([-200.0, -88.0, -87.5, 87.5, 88.5, 200.0, float("nan")])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_host_ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5,
                               equal_nan=True)


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 7), (2, 3, 16), (0, 8), (3, 2 * 21)])
def test_gelu_tanh_mul_matches_torch(shape):
    """Gemma's MLP: torch's tanh-approximated GELU of the gate times up, gates near zero (tanh's cancellation) and far
    out on both sides (exp's clamps: tanh saturates to +-1), NaN."""
    torch.manual_seed(3)
    gate_up = torch.randn(shape) * 3
    if gate_up.numel() and shape[-1] // 2 >= 7:
        gate_up.view(-1, shape[-1])[0, :7] = torch.tensor([-300.0, -9.0, -1e-4, 1e-6, 9.0, 300.0, float("nan")])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_host_ops.gelu_tanh_mul(gate_up), F.gelu(gate, approximate="tanh") * up,
                               atol=1e-6, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("rows", [1, 5])
def test_rope_in_place_on_the_qkv_output_is_torch_bit_for_bit(rotary_fraction, rows):
    """q and k, split by heads from one QKV output, rotated there in place: torch's values exactly (partial rotary
    leaves the rest of each head alone; v is never touched)."""
    from engine.layers.rotary import get_rope
    torch.manual_seed(2)
    q_heads, kv_heads, head_dim = 4, 2, 16
    rope = get_rope(head_dim, 128, {"rope_theta": 10000.0, "partial_rotary_factor": rotary_fraction})
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.view(rows, -1, head_dim).split([q_heads, kv_heads, kv_heads], dim=1)
    positions = torch.arange(rows) * 7 + 3
    v_before = v.clone()
    cpu_host_ops.set_enabled(False)
    try:
        want_q, want_k = rope(positions, q.clone(), k.clone())
    finally:
        cpu_host_ops.set_enabled(True)
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place, in the QKV output
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(v, v_before)


def test_rope_of_separate_q_and_k_is_left_to_torch():
    """q and k that are not side by side in one buffer (after per-head norms, say): torch's ops."""
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cos, sin = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    assert not cpu_host_ops.rope_(q, k, cos, sin, 16)


@pytest.mark.parametrize("case", ["prefill-sized", "bfloat16", "strided", "grad", "disabled", "fake"])
def test_everything_else_is_left_to_torch(case):
    x, w = torch.randn(2, 64), torch.ones(64)
    if case == "prefill-sized":
        x = torch.randn(2 * cpu_host_ops.MAX_ELEMENTS // 64 + 1, 64)
    elif case == "bfloat16":
        x, w = x.bfloat16(), w.bfloat16()
    elif case == "strided":
        x = torch.randn(64, 2).T
    elif case == "grad":
        x.requires_grad_(True)
    elif case == "disabled":
        cpu_host_ops.set_enabled(False)
    try:
        if case == "fake":
            with FakeTensorMode():
                assert cpu_host_ops.rms_norm(torch.empty(2, 64), torch.empty(64), 1e-6) is None
                assert cpu_host_ops.silu_mul(torch.empty(2, 64)) is None
        else:
            assert cpu_host_ops.rms_norm(x, w, 1e-6) is None
            assert cpu_host_ops.silu_mul(x) is None
    finally:
        cpu_host_ops.set_enabled(True)


@pytest.mark.parametrize("cpu_linear", ["rows", "torch"])
def test_engine_greedy_equals_hf_with_the_fused_ops_on_and_off(cpu_linear, reference, monkeypatch):
    """`--cpu-linear torch` turns the fused ops off too: both give HF's greedy ids (on: the engine's default)."""
    from hf_reference import MAX_TOKENS, engine_greedy

    path, prompts, expected = reference("llama")
    calls, norm = [], cpu_host_ops.rms_norm
    monkeypatch.setattr(cpu_host_ops, "rms_norm", lambda *args: calls.append(norm(*args)) or calls[-1])
    try:
        assert engine_greedy(path, prompts, MAX_TOKENS, max_model_len=512, cpu_linear=cpu_linear) == expected
        assert cpu_host_ops.available() == (cpu_linear != "torch")
        assert calls and all((c is not None) == (cpu_linear != "torch") for c in calls)  # the decode steps' norms
    finally:
        cpu_host_ops.set_enabled(True)
