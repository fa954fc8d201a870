"""The Gated DeltaNet torch reference (kernels/gated_delta_torch.py) against HF's own torch functions in
transformers' qwen3_next modelling file: the chunked and recurrent gated delta rule and the causal conv1d
(prefill and cached update), on random inputs. Varlen batches mix one-token decode rows with prefill rows,
state slots are scattered in a pool and updated in place, chunk sizes do not divide the lengths, and the
value heads GQA-expand the key heads. HF's functions are taken unwrapped (inspect.unwrap) so that an
installed fla never replaces the torch oracle. Float32 throughout; tolerance 1e-4 (float32 rounding of two
orderings of the same sums)."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from kernels.gated_delta_torch import (causal_conv1d_varlen, chunk_gated_delta_rule, gated_delta_rule_varlen,
                                       recurrent_gated_delta_rule)

HF_CHUNK = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
HF_RECURRENT = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)
HF_CONV = inspect.unwrap(hf.causal_conv1d_fn)
HF_CONV_UPDATE = inspect.unwrap(hf.causal_conv1d_update)
ATOL = RTOL = 1e-4


def random_rule_inputs(gen, batch, length, hk, hv, dk, dv):
    q = torch.randn(batch, length, hk, dk, generator=gen)
    k = torch.randn(batch, length, hk, dk, generator=gen)
    v = torch.randn(batch, length, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(batch, length, hv, generator=gen)) * 0.5  # log-decay <= 0, as the layer makes it
    beta = torch.rand(batch, length, hv, generator=gen).sigmoid()
    return q, k, v, g, beta


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------- single-sequence oracles against HF

@pytest.mark.parametrize("length,chunk_size,hk,hv", [(1, 64, 2, 2), (37, 16, 2, 4), (64, 64, 1, 2), (70, 32, 2, 2)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_and_recurrent_oracles_match_hf(length, chunk_size, hk, hv, with_state):
    gen = torch.Generator().manual_seed(length * 7 + hv)
    q, k, v, g, beta = random_rule_inputs(gen, 2, length, hk, hv, 8, 12)
    state = torch.randn(2, hv, 8, 12, generator=gen) if with_state else None
    for norm in (True, False):
        if not norm:  # unnormalised keys must keep beta |k|^2 < 2 or the rule itself diverges
            k = k / k.norm(dim=-1, keepdim=True)
        expected, expected_state = HF_CHUNK(q, k, v, g, beta, chunk_size=chunk_size, initial_state=state,
                                            output_final_state=True, use_qk_l2norm_in_kernel=norm)
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=state,
                                            output_final_state=True, use_qk_l2norm_in_kernel=norm)
        close(out, expected)
        close(final, expected_state)
        rec_expected, rec_state = HF_RECURRENT(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                               use_qk_l2norm_in_kernel=norm)
        rec_out, rec_final = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=norm)
        close(rec_out, rec_expected)
        close(rec_final, rec_state)
        close(out, rec_out)  # the two forms are one rule
    if state is not None:
        kept = state.clone()
        assert chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state)[1] is None
        recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
        assert torch.equal(state, kept)  # the oracles never write the caller's initial state


def test_explicit_scale_and_half_inputs_keep_a_float32_state():
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = random_rule_inputs(gen, 1, 20, 2, 2, 8, 8)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, output_final_state=True, scale=0.25)
    expected, _ = recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.25)
    close(out, expected)
    half_out, half_state = chunk_gated_delta_rule(q.half(), k.half(), v.half(), g, beta.half(), chunk_size=8,
                                                  output_final_state=True, scale=0.25)
    assert half_out.dtype == torch.float16 and half_state.dtype == torch.float32
    torch.testing.assert_close(half_out.float(), out, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- packed varlen batch against per-sequence HF

def varlen_batch(gen, lengths, hk, hv, dk, dv):
    total = sum(lengths)
    q, k, v, g, beta = (t[0] for t in random_rule_inputs(gen, 1, total, hk, hv, dk, dv))
    starts = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, g, beta, starts


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_varlen_rule_matches_hf_per_sequence_and_updates_scattered_slots_in_place(chunk_size):
    gen = torch.Generator().manual_seed(chunk_size)
    hk, hv, dk, dv = 2, 4, 8, 16
    lengths = [1, 37, 1, 5, 70, 1]  # decode rows between prefill rows, lengths not multiples of the chunk
    slots = torch.tensor([7, 2, 5, 0, 3, 8], dtype=torch.int32)
    has_initial = torch.tensor([True, False, True, True, False, False])
    q, k, v, g, beta, starts = varlen_batch(gen, lengths, hk, hv, dk, dv)
    pool = torch.randn(9, hv, dk, dv, generator=gen)
    before = pool.clone()
    pool_address = pool.data_ptr()
    o = gated_delta_rule_varlen(q, k, v, g, beta, pool, slots, starts, has_initial, chunk_size=chunk_size)
    assert pool.data_ptr() == pool_address and o.shape == v.shape
    for i, slot in enumerate(slots.tolist()):
        a, b = starts[i].item(), starts[i + 1].item()
        initial = before[slot:slot + 1] if has_initial[i] else None
        hf_rule = HF_RECURRENT if b - a == 1 else HF_CHUNK
        args = dict(chunk_size=chunk_size) if b - a > 1 else {}
        expected, expected_state = hf_rule(q[None, a:b], k[None, a:b], v[None, a:b], g[None, a:b],
                                           beta[None, a:b], initial_state=initial, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, **args)
        close(o[a:b], expected[0])
        close(pool[slot], expected_state[0])
    untouched = [s for s in range(9) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_varlen_chunked_prefill_continues_from_the_slot_and_decode_follows():
    gen = torch.Generator().manual_seed(11)
    q, k, v, g, beta = (t[0] for t in random_rule_inputs(gen, 1, 42, 1, 2, 8, 8))
    expected, expected_state = HF_CHUNK(q[None], k[None], v[None], g[None], beta[None], chunk_size=16,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    pool = torch.full((3, 2, 8, 8), float("nan"))  # a fresh slot may hold anything
    slot = torch.tensor([1], dtype=torch.int32)
    pieces = []
    for a, b, initial in ((0, 23, False), (23, 41, True), (41, 42, True)):  # two prefill chunks, one decode
        loc = torch.tensor([0, b - a], dtype=torch.int32)
        pieces.append(gated_delta_rule_varlen(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pool, slot, loc,
                                              torch.tensor([initial]), chunk_size=16))
    close(torch.cat(pieces), expected[0])
    close(pool[1], expected_state[0])
    assert pool[[0, 2]].isnan().all()


def test_varlen_all_decode_rows_match_the_recurrent_oracle_batched():
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, starts = varlen_batch(gen, [1] * 5, 2, 4, 8, 8)
    pool = torch.randn(6, 4, 8, 8, generator=gen)
    before = pool.clone()
    slots = torch.tensor([4, 0, 5, 2, 1], dtype=torch.int32)
    has_initial = torch.tensor([True, True, False, True, True])
    o = gated_delta_rule_varlen(q, k, v, g, beta, pool, slots, starts, has_initial)
    initial = before[slots.long()] * has_initial[:, None, None, None]
    expected, expected_state = HF_RECURRENT(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                            initial_state=initial, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    close(o, expected[:, 0])
    close(pool[slots.long()], expected_state)
    assert torch.equal(pool[3], before[3])


# ---------------------------------------------------------------- causal conv1d against HF

def hf_conv_with_state(x_seq, prev, weight, bias):
    """HF's cached prefill path: convolve [previous K-1 inputs, new inputs] and keep the new positions."""
    full = torch.cat([prev, x_seq.t()], dim=-1)[None]
    return HF_CONV(full, weight, bias, activation="silu")[0, :, -x_seq.shape[0]:].t()


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv1d_varlen_matches_hf_prefill_and_update(width, with_bias):
    gen = torch.Generator().manual_seed(width * 2 + with_bias)
    channels = 24
    lengths = [1, 9, 2, 1, 1, 17]  # decode rows; a prefill shorter than K-1 new inputs for width 4 (2 tokens)
    starts = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen) if with_bias else None
    slots = torch.tensor([3, 0, 6, 1, 4, 5], dtype=torch.int32)
    has_initial = torch.tensor([True, False, True, True, False, True])
    pool = torch.randn(7, channels, width - 1, generator=gen)
    before = pool.clone()
    y = causal_conv1d_varlen(x, weight, bias, pool, slots, starts, has_initial)
    for i, slot in enumerate(slots.tolist()):
        a, b = starts[i].item(), starts[i + 1].item()
        prev = before[slot] if has_initial[i] else torch.zeros(channels, width - 1)
        if b - a == 1:  # HF's decode path keeps K inputs in its state; the oldest one is not read
            hf_state = torch.cat([torch.randn(channels, 1, generator=gen), prev], dim=-1)[None]
            expected = HF_CONV_UPDATE(x[None, a:b].transpose(1, 2), hf_state, weight, bias, "silu")[0].t()
            close(pool[slot], hf_state[0, :, 1:])
        else:
            expected = hf_conv_with_state(x[a:b], prev, weight, bias)
            close(pool[slot], torch.cat([prev, x[a:b].t()], dim=-1)[:, -(width - 1):])
        close(y[a:b], expected)
    assert torch.equal(pool[2], before[2])
    no_state = causal_conv1d_varlen(x[1:10], weight, bias, pool.clone(), slots[1:2],
                                    torch.tensor([0, 9], dtype=torch.int32), torch.tensor([False]))
    close(no_state, HF_CONV(x[None, 1:10].transpose(1, 2), weight, bias, activation="silu")[0].t())


def test_conv1d_without_activation_and_in_half_precision():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 8, generator=gen)
    weight = torch.randn(8, 4, generator=gen)
    loc, slot = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    fresh = torch.tensor([False])
    linear = causal_conv1d_varlen(x, weight, None, torch.zeros(1, 8, 3), slot, loc, fresh, activation=None)
    close(linear, HF_CONV(x.t()[None], weight, None, activation=None)[0].t())
    half_pool = torch.zeros(1, 8, 3, dtype=torch.float16)
    half = causal_conv1d_varlen(x.half(), weight.half(), None, half_pool, slot, loc, fresh)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), F.silu(linear), atol=1e-2, rtol=1e-2)
    assert torch.equal(half_pool[0], x[-3:].t().half())


# ---------------------------------------------------------------- bad input names the tensor

def test_bad_inputs_raise_errors_that_name_the_tensor():
    q = torch.randn(4, 2, 8)
    v = torch.randn(4, 3, 8)
    g = beta = torch.zeros(4, 3)
    pool = torch.zeros(2, 3, 8, 8)
    loc, slots, init = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0]), torch.tensor([False])
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule_varlen(q, q, v, g, beta, pool, slots, loc, init)
    v = torch.randn(4, 4, 8)
    with pytest.raises(ValueError, match=r"g must be \[4, 4\]"):
        gated_delta_rule_varlen(q, q, v, g, beta, torch.zeros(2, 4, 8, 8), slots, loc, init)
    g = beta = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="ssm_states must be float32"):
        gated_delta_rule_varlen(q, q, v, g, beta, torch.zeros(2, 4, 8, 8, dtype=torch.bfloat16), slots, loc, init)
    with pytest.raises(ValueError, match="query_start_loc must run from 0 to the 4 tokens"):
        gated_delta_rule_varlen(q, q, v, g, beta, torch.zeros(2, 4, 8, 8), slots, torch.tensor([0, 3]), init)
    with pytest.raises(ValueError, match=r"state_indices must lie in \[0, 2\)"):
        gated_delta_rule_varlen(q, q, v, g, beta, torch.zeros(2, 4, 8, 8), torch.tensor([2]), loc, init)
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"conv_states must be \[num_slots, 6, 3\]"):
        causal_conv1d_varlen(x, torch.randn(6, 4), None, torch.zeros(2, 6, 4), slots, loc, init)
    with pytest.raises(ValueError, match="unknown conv1d activation 'gelu'"):
        causal_conv1d_varlen(x, torch.randn(6, 4), None, torch.zeros(2, 6, 3), slots, loc, init, activation="gelu")


def test_read_only_rows_leave_their_slots_and_a_replay_of_the_accepted_tokens_continues_them():
    """Speculative verify rows (read_only_state): the same outputs as ever, their slots untouched (a
    one-token row and a chunked one), the other rows' slots updated; replaying a prefix of each verify row
    then equals running just that prefix."""
    gen = torch.Generator().manual_seed(9)
    lengths = [3, 1, 5, 1]
    loc = torch.tensor([0, 3, 4, 9, 10], dtype=torch.int32)
    slots, has_initial = torch.tensor([2, 0, 4, 1], dtype=torch.int32), torch.ones(4, dtype=torch.bool)
    read_only = torch.tensor([True, False, False, True])
    q, k, v = (torch.randn(10, 2, 8, generator=gen) for _ in range(3))
    g, beta = -torch.rand(10, 2, generator=gen), torch.rand(10, 2, generator=gen)
    x, weight = torch.randn(10, 6, generator=gen), torch.randn(6, 4, generator=gen)
    ssm, conv = torch.randn(5, 2, 8, 8, generator=gen) * 0.1, torch.randn(5, 6, 3, generator=gen)
    got_ssm, got_conv, want_ssm, want_conv = ssm.clone(), conv.clone(), ssm.clone(), conv.clone()
    close(gated_delta_rule_varlen(q, k, v, g, beta, got_ssm, slots, loc, has_initial, read_only_state=read_only),
          gated_delta_rule_varlen(q, k, v, g, beta, want_ssm, slots, loc, has_initial))
    close(causal_conv1d_varlen(x, weight, None, got_conv, slots, loc, has_initial, read_only_state=read_only),
          causal_conv1d_varlen(x, weight, None, want_conv, slots, loc, has_initial))
    kept, moved = [2, 1], [0, 4]
    assert torch.equal(got_ssm[kept], ssm[kept]) and torch.equal(got_conv[kept], conv[kept])
    assert torch.equal(got_ssm[moved], want_ssm[moved]) and torch.equal(got_conv[moved], want_conv[moved])
    rows, replay_loc = torch.tensor([0, 1, 9]), torch.tensor([0, 2, 3], dtype=torch.int32)  # 2 of 3, 1 of 1
    replay_slots, ones = slots[[0, 3]], torch.ones(2, dtype=torch.bool)
    gated_delta_rule_varlen(q[rows], k[rows], v[rows], g[rows], beta[rows], got_ssm, replay_slots, replay_loc, ones)
    causal_conv1d_varlen(x[rows], weight, None, got_conv, replay_slots, replay_loc, ones)
    direct_ssm, direct_conv = ssm.clone(), conv.clone()
    gated_delta_rule_varlen(q[rows], k[rows], v[rows], g[rows], beta[rows], direct_ssm, replay_slots, replay_loc,
                            ones)
    causal_conv1d_varlen(x[rows], weight, None, direct_conv, replay_slots, replay_loc, ones)
    assert torch.equal(got_ssm[kept], direct_ssm[kept]) and torch.equal(got_conv[kept], direct_conv[kept])
    with pytest.raises(ValueError, match=r"read_only_state must be \[4\]"):
        gated_delta_rule_varlen(q, k, v, g, beta, ssm, slots, loc, has_initial, read_only_state=read_only[:2])
