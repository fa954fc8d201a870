"""The Gated DeltaNet Triton kernels (kernels/triton_gated_delta.py, kernels/triton_causal_conv1d.py) against
the torch reference (kernels/gated_delta_torch.py), run on CPU by the Triton interpreter.

TRITON_INTERPRET=1 is set before triton is first imported; when another module imported triton compiled
earlier in this process, `test_whole_module_in_a_fresh_process` reruns this file in a subprocess (see
tests/interpreted.py). Shapes stay tiny (the interpreter pays per program instance and per op): 16-wide
heads, one or two key heads. Varlen batches mix decode rows with prefill rows whose lengths are not
multiples of the kernel's chunk, slots are scattered in the pool, the value heads GQA-expand the key heads,
q/k/v are strided views of one packed projection as the layer makes them. fp32 and fp16 only (bf16 tl.dot
is wrong in the interpreter). Tolerances (atol = rtol): fp32 1e-4, fp16 2e-3.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402  (everything below may import triton)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from interpreted import fresh_process_tests  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels import gated_delta_torch as reference  # noqa: E402
from kernels import triton_causal_conv1d, triton_gated_delta  # noqa: E402

IN_INTERPRETER = isinstance(tl.standard.sum, InterpretedFunction) and isinstance(
    triton_gated_delta.fused_recurrent_kernel, InterpretedFunction)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}

test_whole_module_in_a_fresh_process, skip_unless_interpreted = fresh_process_tests(__file__, IN_INTERPRETER)


def test_kernels_run_in_the_interpreter():
    assert isinstance(triton_causal_conv1d.causal_conv1d_kernel, InterpretedFunction)
    assert isinstance(triton_gated_delta.chunk_prepare_kernel, InterpretedFunction)


def start_loc(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def packed_rule_inputs(gen, num_tokens, hk, hv, d, dtype):
    """q, k, v as strided views of one [T, 2*Hk*D + Hv*D] projection (as the layer splits its conv output)."""
    packed = torch.randn(num_tokens, (2 * hk + hv) * d, generator=gen).to(dtype)
    q, k, v = packed.split([hk * d, hk * d, hv * d], dim=-1)
    q, k, v = q.view(num_tokens, hk, d), k.view(num_tokens, hk, d), v.view(num_tokens, hv, d)
    g = -F.softplus(torch.randn(num_tokens, hv, generator=gen)) * 0.5
    beta = torch.rand(num_tokens, hv, generator=gen).to(dtype)
    return q, k, v, g, beta


def run_both(rule_args, pool, slots, loc, has_initial, **kwargs):
    """(reference o, reference pool, triton o, triton pool) from the same inputs and starting pool."""
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref_o = reference.gated_delta_rule_varlen(*rule_args, ref_pool, slots, loc, has_initial, **kwargs)
    tri_o = triton_gated_delta.gated_delta_rule_varlen(*rule_args, tri_pool, slots, loc, has_initial, **kwargs)
    return ref_o, ref_pool, tri_o, tri_pool


# ---------------------------------------------------------------- gated delta rule

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_prefill_and_decode_batch_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 21, 1, 5]  # decode rows between prefill rows; 21 is one full 16-token chunk and a partial one
    slots = torch.tensor([6, 2, 4, 0], dtype=torch.int32)
    has_initial = torch.tensor([True, True, False, False])  # a continued prefill, a fresh decode row
    args = packed_rule_inputs(gen, sum(lengths), 1, 2, 16, dtype)
    pool = torch.randn(7, 2, 16, 16, generator=gen)
    ref_o, ref_pool, tri_o, tri_pool = run_both(args, pool, slots, start_loc(lengths), has_initial)
    tol = TOLERANCE[dtype]
    assert tri_o.dtype == dtype
    torch.testing.assert_close(tri_o, ref_o, atol=tol, rtol=tol)
    torch.testing.assert_close(tri_pool, ref_pool, atol=tol, rtol=tol)
    untouched = [1, 3, 5]
    assert torch.equal(tri_pool[untouched], pool[untouched])


def test_decode_step_runs_recurrent_only_and_an_empty_padding_sequence_keeps_its_slot():
    gen = torch.Generator().manual_seed(2)
    lengths = [1, 1, 1, 0]  # as many tokens as sequences: the graph-capturable decode path
    num_tokens = 4  # one padding token past query_start_loc[-1]
    args = packed_rule_inputs(gen, num_tokens, 2, 4, 16, torch.float32)
    pool = torch.randn(5, 4, 16, 16, generator=gen)
    slots = torch.tensor([3, 0, 4, 1], dtype=torch.int32)
    has_initial = torch.tensor([True, False, True, False])
    loc = start_loc(lengths)
    tri_pool = pool.clone()
    tri_o = triton_gated_delta.gated_delta_rule_varlen(*args, tri_pool, slots, loc, has_initial)
    ref_pool = pool.clone()
    real = [a[:3] for a in args]
    ref_o = reference.gated_delta_rule_varlen(*real, ref_pool, slots[:3], loc[:4], has_initial[:3])
    torch.testing.assert_close(tri_o[:3], ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tri_pool, ref_pool, atol=1e-4, rtol=1e-4)
    assert torch.equal(tri_o[3], torch.zeros_like(tri_o[3]))
    assert torch.equal(tri_pool[[1, 2]], pool[[1, 2]])  # the empty sequence's slot and the unused one


def test_prefill_without_qk_norm_and_with_an_explicit_scale():
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = packed_rule_inputs(gen, 18, 2, 2, 16, torch.float32)
    k = k / k.norm(dim=-1, keepdim=True)  # unnormalised keys must keep beta |k|^2 < 2 or the rule diverges
    pool = torch.zeros(2, 2, 16, 16)
    ref_o, ref_pool, tri_o, tri_pool = run_both((q, k, v, g, beta), pool, torch.tensor([1], dtype=torch.int32),
                                                start_loc([18]), torch.tensor([False]), scale=0.3,
                                                use_qk_l2norm=False)
    torch.testing.assert_close(tri_o, ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tri_pool, ref_pool, atol=1e-4, rtol=1e-4)


def test_bad_state_pool_is_refused_before_any_launch():
    q = torch.randn(2, 1, 16)
    v = torch.randn(2, 2, 16)
    g = beta = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="ssm_states must be float32"):
        triton_gated_delta.gated_delta_rule_varlen(q, q, v, g, beta, torch.zeros(1, 2, 16, 16, dtype=torch.float16),
                                                   torch.tensor([0]), start_loc([2]), torch.tensor([False]))


# ---------------------------------------------------------------- causal conv1d

def test_conv1d_mixed_batch_with_padding_tokens_matches_the_reference():
    gen = torch.Generator().manual_seed(4)
    channels, width = 40, 4  # 40 channels: a partial channel block
    lengths = [1, 9, 2, 1]  # a prefill of 2 tokens keeps one old input in its state (K-1 = 3)
    loc = start_loc(lengths)
    num_tokens = sum(lengths) + 3  # three padding tokens past query_start_loc[-1]
    x = torch.randn(num_tokens, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen)
    slots = torch.tensor([5, 1, 3, 0], dtype=torch.int32)
    has_initial = torch.tensor([True, False, True, True])
    pool = torch.randn(6, channels, width - 1, generator=gen)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    real = sum(lengths)
    expected = reference.causal_conv1d_varlen(x[:real], weight, bias, ref_pool, slots, loc, has_initial)
    y = triton_causal_conv1d.causal_conv1d_varlen(x, weight, bias, tri_pool, slots, loc, has_initial)
    torch.testing.assert_close(y[:real], expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(y[real:], torch.zeros_like(y[real:]))
    torch.testing.assert_close(tri_pool, ref_pool, atol=0, rtol=0)  # states are copies of inputs


def test_conv1d_half_decode_step_without_bias_or_activation():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 24, generator=gen).half()
    weight = torch.randn(24, 2, generator=gen).half()
    pool = torch.randn(4, 24, 1, generator=gen).half()
    slots, loc = torch.tensor([2, 0, 3], dtype=torch.int32), start_loc([1, 1, 1])
    has_initial = torch.tensor([True, False, True])
    ref_pool, tri_pool = pool.clone(), pool.clone()
    expected = reference.causal_conv1d_varlen(x, weight, None, ref_pool, slots, loc, has_initial, activation=None)
    y = triton_causal_conv1d.causal_conv1d_varlen(x, weight, None, tri_pool, slots, loc, has_initial, activation=None)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, expected, atol=2e-3, rtol=2e-3)
    assert torch.equal(tri_pool, ref_pool)
    assert torch.equal(tri_pool[1], pool[1])


# ---------------------------------------------------------------- speculative verify rows and their replay

def test_verify_rows_read_their_slot_and_the_replay_folds_in_only_the_accepted_tokens():
    """A verify step (engine/spec_decode/state_rollback.py): rows of 1 + k tokens flagged read_only_state
    beside a decode row; the Triton conv and rule (recurrent only: max_query_len given) give the reference's
    outputs and leave the verify rows' slots as they were. Replaying the first 1 + a tokens of each verify
    row then brings its slots where the reference gets over just those tokens."""
    gen = torch.Generator().manual_seed(6)
    lengths = [4, 1, 3]  # verify 1 + 3 (one draft accepted below), a decode, verify 1 + 2 (both accepted)
    loc, slots = start_loc(lengths), torch.tensor([3, 0, 1], dtype=torch.int32)
    has_initial, read_only = torch.ones(3, dtype=torch.bool), torch.tensor([True, False, True])
    x = torch.randn(sum(lengths), 40, generator=gen)
    weight = torch.randn(40, 4, generator=gen)
    args = packed_rule_inputs(gen, sum(lengths), 1, 2, 16, torch.float32)
    conv_pool, ssm_pool = torch.randn(4, 40, 3, generator=gen), torch.randn(4, 2, 16, 16, generator=gen) * 0.1
    tri_conv, tri_ssm, ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.clone(), conv_pool.clone(), ssm_pool.clone()
    y = triton_causal_conv1d.causal_conv1d_varlen(x, weight, None, tri_conv, slots, loc, has_initial,
                                                  read_only_state=read_only)
    o = triton_gated_delta.gated_delta_rule_varlen(*args, tri_ssm, slots, loc, has_initial,
                                                   read_only_state=read_only, max_query_len=4)
    ref_y = reference.causal_conv1d_varlen(x, weight, None, ref_conv, slots, loc, has_initial)
    ref_o = reference.gated_delta_rule_varlen(*args, ref_ssm, slots, loc, has_initial)
    torch.testing.assert_close(y, ref_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o, ref_o, atol=1e-4, rtol=1e-4)
    verify = [3, 1]
    assert torch.equal(tri_conv[verify], conv_pool[verify]) and torch.equal(tri_ssm[verify], ssm_pool[verify])
    torch.testing.assert_close(tri_conv[0], ref_conv[0], atol=0, rtol=0)  # the decode row moved on
    torch.testing.assert_close(tri_ssm[0], ref_ssm[0], atol=1e-4, rtol=1e-4)
    rows = torch.tensor([0, 1, 5, 6, 7])  # 1 + a tokens of each verify row
    replay_loc, replay_slots = start_loc([2, 3]), slots[[0, 2]]
    ones = torch.ones(2, dtype=torch.bool)
    triton_causal_conv1d.causal_conv1d_varlen(x[rows], weight, None, tri_conv, replay_slots, replay_loc, ones)
    triton_gated_delta.gated_delta_rule_varlen(*(a[rows] for a in args), tri_ssm, replay_slots, replay_loc, ones,
                                               max_query_len=3)
    want_conv, want_ssm = conv_pool.clone(), ssm_pool.clone()
    reference.causal_conv1d_varlen(x[rows], weight, None, want_conv, replay_slots, replay_loc, ones)
    reference.gated_delta_rule_varlen(*(a[rows] for a in args), want_ssm, replay_slots, replay_loc, ones)
    torch.testing.assert_close(tri_conv[verify], want_conv[verify], atol=0, rtol=0)
    torch.testing.assert_close(tri_ssm[verify], want_ssm[verify], atol=1e-4, rtol=1e-4)
