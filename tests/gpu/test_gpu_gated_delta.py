"""The Gated DeltaNet Triton kernels against the torch reference on the real card: bf16/fp16 activations with
the float32 state, Qwen3.6-27B head shapes (head dim 128, value heads 3x the key heads), prefill rows long
enough for many chunks mixed with decode rows, scattered slots; and the decode step (conv1d + rule) captured
in a CUDA graph, replayed on fresh inputs, equal to the eager kernels (a host sync in the decode path would
fail the capture)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import gated_delta_torch as reference
from kernels import triton_causal_conv1d, triton_gated_delta

pytestmark = pytest.mark.gpu
HK, HV, D, WIDTH = 4, 12, 128, 4
CONV_DIM = (2 * HK + HV) * D


def start_loc(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def layer_inputs(lengths, dtype, num_slots, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    return dict(
        x=torch.randn(total, CONV_DIM, device="cuda", generator=gen).to(dtype),
        weight=(torch.randn(CONV_DIM, WIDTH, device="cuda", generator=gen) * 0.3).to(dtype),
        bias=None,
        g=-F.softplus(torch.randn(total, HV, device="cuda", generator=gen)) * 0.3,
        beta=torch.rand(total, HV, device="cuda", generator=gen).to(dtype),
        conv_states=torch.randn(num_slots, CONV_DIM, WIDTH - 1, device="cuda", generator=gen).to(dtype),
        ssm_states=torch.randn(num_slots, HV, D, D, device="cuda", generator=gen) * 0.1,
    )


def run_layer(conv, rule, inputs, conv_states, ssm_states, slots, loc, has_initial):
    y = conv(inputs["x"], inputs["weight"], inputs["bias"], conv_states, slots, loc, has_initial)
    q, k, v = y.split([HK * D, HK * D, HV * D], dim=-1)
    q, k, v = q.view(-1, HK, D), k.view(-1, HK, D), v.view(-1, HV, D)
    return y, rule(q, k, v, inputs["g"], inputs["beta"], ssm_states, slots, loc, has_initial)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_layer_kernels_match_the_reference_on_the_card(dtype):
    lengths = [1, 300, 1, 77, 1000, 1, 16]
    slots = torch.tensor([9, 2, 14, 0, 5, 11, 7], dtype=torch.int32, device="cuda")
    has_initial = torch.tensor([True, False, True, True, False, True, True], device="cuda")
    inputs = layer_inputs(lengths, dtype, 16, seed=0)
    loc = start_loc(lengths)
    results = []
    for conv, rule in ((reference.causal_conv1d_varlen, reference.gated_delta_rule_varlen),
                       (triton_causal_conv1d.causal_conv1d_varlen, triton_gated_delta.gated_delta_rule_varlen)):
        conv_states, ssm_states = inputs["conv_states"].clone(), inputs["ssm_states"].clone()
        y, o = run_layer(conv, rule, inputs, conv_states, ssm_states, slots, loc, has_initial)
        results.append((y.float(), o.float(), conv_states, ssm_states))
    (y_ref, o_ref, conv_ref, ssm_ref), (y_tri, o_tri, conv_tri, ssm_tri) = results
    assert ssm_tri.dtype == torch.float32
    assert torch.equal(conv_tri, conv_ref)  # conv states are copies of the inputs
    for name, tri, ref in (("conv out", y_tri, y_ref), ("rule out", o_tri, o_ref), ("ssm state", ssm_tri, ssm_ref)):
        err = float((tri - ref).abs().max())
        assert err <= 2e-2 * max(1.0, float(ref.abs().max())), f"{name}: max |triton - torch| = {err:.3e}"
    untouched = [1, 3, 4, 6, 8, 10, 12, 13, 15]
    assert torch.equal(ssm_tri[untouched], inputs["ssm_states"][untouched])


def test_decode_step_replays_in_a_cuda_graph():
    batch, num_slots = 8, 12
    slots = torch.tensor([3, 0, 7, 11, 5, 1, 9, 4], dtype=torch.int32, device="cuda")
    loc = start_loc([1] * batch)
    has_initial = torch.ones(batch, dtype=torch.bool, device="cuda")
    static = layer_inputs([1] * batch, torch.bfloat16, num_slots, seed=1)
    conv_states, ssm_states = static["conv_states"].clone(), static["ssm_states"].clone()
    kernels = (triton_causal_conv1d.causal_conv1d_varlen, triton_gated_delta.gated_delta_rule_varlen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture, on scratch states
        run_layer(*kernels, static, conv_states.clone(), ssm_states.clone(), slots, loc, has_initial)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, graph_out = run_layer(*kernels, static, conv_states, ssm_states, slots, loc, has_initial)
    for step in range(3):  # each replay reads new inputs from the static buffers and advances the states
        fresh = layer_inputs([1] * batch, torch.bfloat16, num_slots, seed=10 + step)
        for name in ("x", "g", "beta"):
            static[name].copy_(fresh[name])
        eager_conv, eager_ssm = conv_states.clone(), ssm_states.clone()
        _, eager_out = run_layer(*kernels, static, eager_conv, eager_ssm, slots, loc, has_initial)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, eager_out), f"step {step}: graph output differs from eager"
        assert torch.equal(ssm_states, eager_ssm) and torch.equal(conv_states, eager_conv)
