"""Triton gated delta rule over packed varlen batches, reading and writing the float32 state pool in place.

Same signature and results as kernels/gated_delta_torch.gated_delta_rule_varlen (see it for the layout).
Two paths:
- recurrent (`fused_recurrent_kernel`): one program per (sequence, value head, value block) loads its slot's
  state once, steps through the sequence's tokens and stores the state back. A batch with as many tokens as
  sequences (a decode step) runs only this kernel, without a host sync or a data-dependent shape, so it can
  be captured in a CUDA graph; tokens at or past query_start_loc[-1] are left 0.
- chunked (prefill rows): `chunk_prepare_kernel` solves every chunk's delta-rule system at once, in parallel
  over chunks and heads (u = M beta v and w = M beta exp(c) k with M = (I + A)^-1 by forward substitution);
  `chunk_state_kernel` then walks each sequence's chunks in order carrying the state (prefill steps run
  these layers eagerly, between the piecewise graphs' pieces).
All math is float32 (loads are upcast). The chunked kernels' dots take TF32 inputs (tensor cores on sm_80+)
when the activations are 16-bit, IEEE float32 for float32 activations: against a float64 oracle over 4,096
tokens at head dim 128 (strong and weak decay), TF32 dots leave 6-7e-4 relative error in the outputs and
~5e-4 in the carried state, an order below the bf16 rounding of the outputs themselves (4e-3); bf16 dots
would leave ~5e-3 in the state (tests/test_gated_delta_precision.py emulates the kernels' algorithm;
tests/gpu/test_gpu_gated_delta.py measures the kernels). The chunk table (which sequence each 16-token chunk
belongs to) comes from the step's metadata, built once on the host (kernels/gated_delta_chunks.py); without
one, query_start_loc is read on the host here. Imports nothing of ours but the reference's shape checks and
the chunk table.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_chunks import CHUNK, ChunkTable, chunk_arrays
from kernels.gated_delta_torch import check_gated_delta_inputs, read_only_flags

DECODE_BLOCK_V = 32
PREPARE_BLOCK_V = 32
# The state walk holds a [Dk, BLOCK_V] state and [16, Dk] q, k, w tiles: at Dk = 128 ptxas (sm_86) spills
# 1684 B with BLOCK_V 32 on 4 warps, 772 B on 8, 900 B with 16 on 4, none with 16 on 8 (255 registers).
STATE_BLOCK_V, STATE_WARPS = 16, 8
# Rows this short take the recurrent kernel when the caller says so (max_query_len): the loop over a few
# tokens costs less than the chunked path's two launches and its host-side chunk table.
RECURRENT_MAX_LEN = 16


@triton.jit
def fused_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, start_ptr, slot_ptr, init_ptr,
                           keep_ptr, scale, max_len, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_gt, stride_bt, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
                           HEAD_GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_V: tl.constexpr, L2NORM: tl.constexpr):
    seq, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = hv // HEAD_GROUP
    kk = tl.arange(0, BLOCK_K)
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < DK, vv < DV
    start, end = tl.load(start_ptr + seq), tl.load(start_ptr + seq + 1)
    # longer sequences belong to the chunked path; an empty one (padding) keeps its slot untouched
    mine = (((end - start) <= max_len) & (end > start)).to(tl.int32)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    init = tl.load(init_ptr + seq).to(tl.int32)
    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    # scalar flags join masks as tensors (the interpreter rejects a scalar bool broadcast into a mask)
    state = tl.load(s_ptrs, mask=s_mask & (kk[:, None] * 0 + mine * init != 0), other=0.0)
    t0 = start.to(tl.int64)  # pointers walk the sequence's rows (int64: T * stride can pass 2^31)
    q_row = q_ptr + t0 * stride_qt + hk * stride_qh + kk
    k_row = k_ptr + t0 * stride_kt + hk * stride_kh + kk
    v_row = v_ptr + t0 * stride_vt + hv * stride_vh + vv
    o_row = o_ptr + t0 * stride_ot + hv * stride_oh + vv
    g_row = g_ptr + t0 * stride_gt + hv
    beta_row = beta_ptr + t0 * stride_bt + hv
    for _ in range(0, (end - start) * mine):
        q = tl.load(q_row, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_row, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_row, mask=v_ok, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        g = tl.load(g_row).to(tl.float32)
        beta = tl.load(beta_row).to(tl.float32)
        state = state * tl.exp(g)
        delta = (v - tl.sum(state * k[:, None], 0)) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * (q * scale)[:, None], 0)
        tl.store(o_row, o.to(o_ptr.dtype.element_ty), mask=v_ok)
        q_row += stride_qt
        k_row += stride_kt
        v_row += stride_vt
        o_row += stride_ot
        g_row += stride_gt
        beta_row += stride_bt
    read_only = tl.load(keep_ptr + seq).to(tl.int32)  # a verify row: its slot is advanced later, by replay
    tl.store(s_ptrs, state, mask=s_mask & (kk[:, None] * 0 + mine * (1 - read_only) != 0))


@triton.jit
def _load_keys(k_ptr, rows, row_ok, hk, stride_kt, stride_kh, kk, k_ok, L2NORM: tl.constexpr):
    k = tl.load(k_ptr + rows.to(tl.int64)[:, None] * stride_kt + hk * stride_kh + kk[None, :],
                mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    return k


@triton.jit
def chunk_prepare_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, c_ptr, chunk_seq_ptr, chunk_first_ptr,
                         start_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                         HV: tl.constexpr, HEAD_GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
                         DOT: tl.constexpr):
    chunk, hv = tl.program_id(0), tl.program_id(1)
    hk = hv // HEAD_GROUP
    seq = tl.load(chunk_seq_ptr + chunk)
    first = tl.load(chunk_first_ptr + chunk)
    end = tl.load(start_ptr + seq + 1)
    r = tl.arange(0, BT)
    rows = first + r
    row_ok = rows < end  # rows past the sequence act as g = beta = k = v = 0: no effect on the state
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < DK
    k = _load_keys(k_ptr, rows, row_ok, hk, stride_kt, stride_kh, kk, k_ok, L2NORM)
    rows64 = rows.to(tl.int64)
    g = tl.load(g_ptr + rows64 * stride_gt + hv, mask=row_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows64 * stride_bt + hv, mask=row_ok, other=0.0).to(tl.float32)
    c = tl.cumsum(g, 0)  # log-decay from the chunk start through each row
    tl.store(c_ptr + rows64 * HV + hv, c, mask=row_ok)
    k_beta = k * beta[:, None]
    lower = r[:, None] > r[None, :]
    a = tl.dot(k_beta, tl.trans(k), input_precision=DOT)
    a = tl.where(lower, a * tl.exp(tl.where(lower, c[:, None] - c[None, :], 0.0)), 0.0)
    # M = (I + A)^-1 by forward substitution, M_i = e_i - sum_{j<i} A_ij M_j (A strictly lower): row i of
    # A @ M needs only the rows set before it. A 16x16 dot per row is cheap at BT = 16 and keeps the loop
    # free of reductions (each one a costly call in the interpreter).
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    m = eye
    for i in range(1, BT):
        m = tl.where(r[:, None] == i, eye - tl.dot(a, m, input_precision=DOT), m)
    w = tl.dot(m, k_beta * tl.exp(c)[:, None], input_precision=DOT)
    tl.store(w_ptr + (rows64[:, None] * HV + hv) * DK + kk[None, :], w, mask=row_ok[:, None] & k_ok[None, :])
    for vb in range(0, tl.cdiv(DV, BLOCK_V)):
        vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = vv < DV
        v = tl.load(v_ptr + rows64[:, None] * stride_vt + hv * stride_vh + vv[None, :],
                    mask=row_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        u = tl.dot(m, v * beta[:, None], input_precision=DOT)
        tl.store(u_ptr + (rows64[:, None] * HV + hv) * DV + vv[None, :], u, mask=row_ok[:, None] & v_ok[None, :])


@triton.jit
def chunk_state_kernel(q_ptr, k_ptr, u_ptr, w_ptr, c_ptr, o_ptr, state_ptr, long_seq_ptr, start_ptr, slot_ptr,
                       init_ptr, keep_ptr, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                       stride_ss, stride_sh, stride_sk, HV: tl.constexpr, HEAD_GROUP: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                       L2NORM: tl.constexpr, DOT: tl.constexpr):
    seq = tl.load(long_seq_ptr + tl.program_id(0))
    hv, vb = tl.program_id(1), tl.program_id(2)
    hk = hv // HEAD_GROUP
    start, end = tl.load(start_ptr + seq), tl.load(start_ptr + seq + 1)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    init = tl.load(init_ptr + seq).to(tl.int32)
    r = tl.arange(0, BT)
    kk = tl.arange(0, BLOCK_K)
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < DK, vv < DV
    s_ptrs = state_ptr + slot * stride_ss + hv * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    state = tl.load(s_ptrs, mask=s_mask & (kk[:, None] * 0 + init != 0), other=0.0)
    causal = r[:, None] >= r[None, :]
    for first in range(start, end, BT):
        rows = first + r
        row_ok = rows < end
        rows64 = rows.to(tl.int64)
        q = _load_keys(q_ptr, rows, row_ok, hk, stride_qt, stride_qh, kk, k_ok, L2NORM) * scale
        k = _load_keys(k_ptr, rows, row_ok, hk, stride_kt, stride_kh, kk, k_ok, L2NORM)
        c = tl.load(c_ptr + rows64 * HV + hv, mask=row_ok, other=0.0)
        c_last = tl.load(c_ptr + (tl.minimum(first + BT, end) - 1).to(tl.int64) * HV + hv)
        c = tl.where(row_ok, c, c_last)  # padded rows carry the last row's decay, as g = 0 would
        u = tl.load(u_ptr + (rows64[:, None] * HV + hv) * DV + vv[None, :], mask=row_ok[:, None] & v_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + (rows64[:, None] * HV + hv) * DK + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        v_new = u - tl.dot(w, state, input_precision=DOT)
        attn = tl.dot(q, tl.trans(k), input_precision=DOT)
        attn = tl.where(causal, attn * tl.exp(tl.where(causal, c[:, None] - c[None, :], 0.0)), 0.0)
        o = tl.dot(q * tl.exp(c)[:, None], state, input_precision=DOT) + tl.dot(attn, v_new,
                                                                                  input_precision=DOT)
        tl.store(o_ptr + rows64[:, None] * stride_ot + hv * stride_oh + vv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & v_ok[None, :])
        k_to_end = k * tl.exp(c_last - c)[:, None]
        state = state * tl.exp(c_last) + tl.dot(tl.trans(k_to_end), v_new, input_precision=DOT)
    read_only = tl.load(keep_ptr + seq).to(tl.int32)
    tl.store(s_ptrs, state, mask=s_mask & (kk[:, None] * 0 + read_only == 0))


def _last_dim_contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                            query_start_loc: torch.Tensor, has_initial_state: torch.Tensor,
                            scale: float | None = None, use_qk_l2norm: bool = True,
                            chunk_size: int = 64, read_only_state: torch.Tensor | None = None,
                            max_query_len: int | None = None, chunks: ChunkTable | None = None) -> torch.Tensor:
    """Triton twin of kernels/gated_delta_torch.gated_delta_rule_varlen: o [T, Hv, Dv] in v.dtype, ssm_states
    [num_slots, Hv, Dk, Dv] float32 updated in place through state_indices (not for rows flagged in
    read_only_state). chunk_size is accepted for the shared signature; the kernel always solves 16-token
    chunks (same result up to float32 rounding). `max_query_len` (the longest row, from the host) of at
    most RECURRENT_MAX_LEN sends every row through the recurrent kernel without a host sync: a speculative
    verify step (1 + k tokens a row) and its replay (engine/spec_decode/state_rollback.py). `chunks`: the step's
    chunk table (kernels/gated_delta_chunks.py), made once on the host; None reads query_start_loc here."""
    check_gated_delta_inputs(q, k, v, g, beta, ssm_states)
    if ssm_states.stride(-1) != 1:
        raise ValueError(f"ssm_states must be contiguous in its last dim; got strides {ssm_states.stride()}")
    q, k, v, g, beta = _last_dim_contiguous(q, k, v, g, beta)
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    num_seqs = state_indices.shape[0]
    scale = dk ** -0.5 if scale is None else scale
    o = torch.zeros_like(v)
    if num_tokens == 0 or num_seqs == 0:
        return o
    init = has_initial_state.to(torch.int8)
    keep = read_only_flags(read_only_state, num_seqs, q.device)
    common = dict(HEAD_GROUP=num_v_heads // num_k_heads, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk),
                  L2NORM=use_qk_l2norm)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    state_strides = ssm_states.stride()[:3]

    def recurrent(max_len: int) -> None:
        fused_recurrent_kernel[(num_seqs, num_v_heads, triton.cdiv(dv, DECODE_BLOCK_V))](
            q, k, v, g, beta, o, ssm_states, query_start_loc, state_indices, init, keep, scale, max_len, *strides,
            v.stride(0), v.stride(1), g.stride(0), beta.stride(0), o.stride(0), o.stride(1), *state_strides,
            BLOCK_V=DECODE_BLOCK_V, **common)

    if num_tokens == num_seqs:  # a decode step (or anything as short): recurrent only, no host sync
        recurrent(num_tokens)
        return o
    if max_query_len is not None and max_query_len <= RECURRENT_MAX_LEN:  # verify rows: a few tokens each
        recurrent(max_query_len)
        return o
    recurrent(1)  # one-token rows; the rest are chunked, as the reference does
    device = q.device
    if chunks is None:  # no table from the step: read the offsets on the host (a sync) and make one
        chunks = ChunkTable(*(torch.from_numpy(a).to(device, non_blocking=True)
                              for a in chunk_arrays(query_start_loc.tolist())))
    num_chunks, num_long = chunks.chunk_seq.shape[0], chunks.long_seqs.shape[0]
    if not num_long:
        return o
    dot = "ieee" if q.dtype == torch.float32 else "tf32"
    u = torch.empty(num_tokens, num_v_heads, dv, dtype=torch.float32, device=device)
    w = torch.empty(num_tokens, num_v_heads, dk, dtype=torch.float32, device=device)
    c = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=device)
    chunk_prepare_kernel[(num_chunks, num_v_heads)](
        k, v, g, beta, u, w, c, chunks.chunk_seq, chunks.chunk_first, query_start_loc, k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), g.stride(0), beta.stride(0), HV=num_v_heads, BT=CHUNK,
        BLOCK_V=min(PREPARE_BLOCK_V, triton.next_power_of_2(dv)), DOT=dot, **common)
    chunk_state_kernel[(num_long, num_v_heads, triton.cdiv(dv, STATE_BLOCK_V))](
        q, k, u, w, c, o, ssm_states, chunks.long_seqs, query_start_loc, state_indices, init, keep, scale, *strides,
        o.stride(0), o.stride(1), *state_strides, HV=num_v_heads, BT=CHUNK, BLOCK_V=STATE_BLOCK_V, DOT=dot,
        num_warps=STATE_WARPS, **common)
    return o
