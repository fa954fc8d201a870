"""The precision of the Triton chunked gated delta rule's dots (issue 32 item 5), against a float64 oracle.

The chunked kernels (kernels/triton_gated_delta.py) run every dot in IEEE float32 for float32 activations and with
TF32 inputs (tensor cores on sm_80+) for 16-bit ones. On CPU the interpreter ignores a dot's precision, so this
test emulates the kernels' algorithm step for step (16-token chunks, (I + A)^-1 by forward substitution, the
state walked from chunk to chunk) with each dot's inputs rounded as the card rounds them (TF32: round to nearest
on 10 mantissa bits), and measures the outputs and the carried state against the token-by-token recurrence in
float64, at Qwen3.6-27B's head dim (128) with strong and weak decay. TF32 leaves 4-7e-4 of the largest value,
an order below the bf16 rounding of the outputs themselves (3.9e-3); bf16 dots would put ~5e-3 into the float32
state. tests/gpu/test_gpu_gated_delta.py measures the kernels themselves against the same oracle on a card."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gated_delta_chunks import CHUNK
from kernels.gated_delta_torch import _recurrent_step, l2norm

TF32_BOUND = 2e-3  # of the largest |value|: outputs and state; what tests/gpu asserts for the kernels too


def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32's 10 mantissa bits, to nearest (ties away), as cvt.rna.tf32.f32 does."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def exact(x: torch.Tensor) -> torch.Tensor:
    return x


def emulated_kernels(q, k, v, g, beta, state, rnd):
    """chunk_prepare_kernel then chunk_state_kernel for one sequence, every dot's inputs through `rnd`.
    q, k [T, H, D] (normalised, q scaled), v [T, H, Dv], g, beta [T, H], state [H, D, Dv]; float32."""
    dot = lambda a, b: rnd(a) @ rnd(b)  # noqa: E731 - float32 accumulation, like the tensor cores'
    T, bt = q.shape[0], CHUNK
    r = torch.arange(bt)
    lower, causal = r[:, None] > r[None, :], r[:, None] >= r[None, :]
    s, out = state.clone(), torch.zeros_like(v)
    for first in range(0, T, bt):
        n = min(bt, T - first)
        qc, kc, vc = (F.pad(t[first:first + n], (0, 0, 0, 0, 0, bt - n)).transpose(0, 1) for t in (q, k, v))
        gc, bc = (F.pad(t[first:first + n], (0, 0, 0, bt - n)).transpose(0, 1) for t in (g, beta))
        c = gc.cumsum(-1)
        kb = kc * bc[..., None]
        a = dot(kb, kc.transpose(-1, -2))
        a = torch.where(lower, a * torch.exp(torch.where(lower, c[..., :, None] - c[..., None, :], 0.0)), 0.0)
        eye = torch.eye(bt).expand_as(a)
        m = eye
        for i in range(1, bt):
            m = torch.where(r[:, None] == i, eye - dot(a, m), m)
        w, u = dot(m, kb * torch.exp(c)[..., None]), dot(m, vc * bc[..., None])
        c_last = c[:, n - 1]
        c = torch.where(r < n, c, c_last[:, None])
        v_new = u - dot(w, s)
        attn = dot(qc, kc.transpose(-1, -2))
        attn = torch.where(causal, attn * torch.exp(torch.where(causal, c[..., :, None] - c[..., None, :], 0.0)), 0.0)
        o = dot(qc * torch.exp(c)[..., None], s) + dot(attn, v_new)
        out[first:first + n] = o[:, :n].transpose(0, 1)
        k_to_end = kc * torch.exp(c_last[:, None] - c)[..., None]
        s = s * torch.exp(c_last)[:, None, None] + dot(k_to_end.transpose(-1, -2), v_new)
    return out, s


def float64_oracle(q, k, v, g, beta, state):
    s = state.double()[None].clone()
    out = torch.empty(v.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        out[t] = _recurrent_step(s, *(x[t][None].double() for x in (q, k, v, g, beta)))[0]
    return out, s[0]


def layer_inputs(tokens: int, decay: float, heads: int = 4, dim: int = 128, seed: int = 0):
    """What a DeltaNet layer hands the kernels: bf16 activations (upcast), normalised q/k, float32 g and state."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q = l2norm(randn(tokens, heads, dim).bfloat16().float()) * dim ** -0.5
    k = l2norm(randn(tokens, heads, dim).bfloat16().float())
    v = randn(tokens, heads, dim).bfloat16().float()
    g = -F.softplus(randn(tokens, heads)) * decay
    beta = torch.rand(tokens, heads, generator=gen).bfloat16().float()
    return q, k, v, g, beta, randn(heads, dim, dim) * 0.1


@pytest.mark.parametrize("decay", [0.3, 0.003], ids=["strong decay", "weak decay"])
def test_tf32_dots_stay_well_below_the_outputs_bf16_rounding(decay):
    inputs = layer_inputs(512, decay)
    want_o, want_s = float64_oracle(*inputs)
    errors = {}
    for name, rnd in (("ieee", exact), ("tf32", tf32), ("bf16", bf16)):
        o, s = emulated_kernels(*inputs, rnd)
        errors[name] = (float((o.double() - want_o).abs().max() / want_o.abs().max()),
                        float((s.double() - want_s).abs().max() / want_s.abs().max()))
    print(f"decay {decay}: relative max error vs float64 (outputs, state): " +
          ", ".join(f"{n} {e[0]:.1e} {e[1]:.1e}" for n, e in errors.items()))
    assert max(errors["ieee"]) < 1e-5  # the emulation is the kernels' algorithm: exact up to float32 rounding
    assert max(errors["tf32"]) < TF32_BOUND
    assert errors["tf32"][0] < 0.5 * 2 ** -8  # below half a bf16 ulp of the largest output
