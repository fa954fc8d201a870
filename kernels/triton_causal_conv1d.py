"""Triton causal conv1d for Gated DeltaNet layers over packed varlen batches, on the conv-state pool in place.

Same signature and results as kernels/gated_delta_torch.causal_conv1d_varlen (see it for the layout). One
kernel convolves every token (decode rows and prefill rows alike: a tap left of its sequence's first token
reads the sequence's slot, or zero for a fresh sequence); a second kernel then writes each slot's last K-1
inputs. Two launches on one stream, so every read of the old state precedes every write. No host sync and
no data-dependent shape (the token -> sequence map is a device searchsorted), so it can be captured in a
CUDA graph; tokens at or past query_start_loc[-1] (a graph's padding) read and write nothing and give 0.
Imports nothing of ours but the reference's shape checks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_torch import check_conv1d_inputs, read_only_flags


BLOCK_T, BLOCK_C = 16, 128


@triton.jit
def causal_conv1d_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, y_ptr, token_seq_ptr, start_ptr, slot_ptr, init_ptr,
                         num_tokens, num_seqs, channels, stride_xt, stride_yt, stride_wc, stride_ss, stride_sc,
                         stride_sk, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    seq = tl.load(token_seq_ptr + t, mask=t < num_tokens, other=num_seqs)
    valid = seq < num_seqs  # false for padding tokens past the last sequence
    seq = tl.where(valid, seq, 0)
    start = tl.load(start_ptr + seq, mask=valid, other=0)
    slot = tl.load(slot_ptr + seq, mask=valid, other=0).to(tl.int64)
    init = tl.load(init_ptr + seq, mask=valid, other=0) != 0
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        src = t - (WIDTH - 1) + j  # the input this tap reads: inside the sequence, or in its saved state
        in_x = src >= start
        x_mask = (valid & in_x)[:, None] & c_ok[None, :]
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_xt + c[None, :], mask=x_mask, other=0.0)
        col = (WIDTH - 1) + (src - start)
        s_mask = (valid & ~in_x & init)[:, None] & c_ok[None, :]
        sv = tl.load(state_ptr + slot[:, None] * stride_ss + c[None, :] * stride_sc + col[:, None] * stride_sk,
                     mask=s_mask, other=0.0)
        w = tl.load(w_ptr + c * stride_wc + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(valid[:, None], acc, 0.0)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * stride_yt + c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(t < num_tokens)[:, None] & c_ok[None, :])


@triton.jit
def conv_state_update_kernel(x_ptr, state_ptr, start_ptr, slot_ptr, init_ptr, keep_ptr, channels, stride_xt,
                             stride_ss, stride_sc, stride_sk, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_C: tl.constexpr):
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_K)
    c_ok, j_ok = c < channels, j < WIDTH - 1
    start, end = tl.load(start_ptr + seq), tl.load(start_ptr + seq + 1)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    init = tl.load(init_ptr + seq).to(tl.int32)
    read_only = tl.load(keep_ptr + seq).to(tl.int32)  # a verify row: its slot is advanced later, by replay
    src = (end - start) - (WIDTH - 1) + j  # new column j holds this input (negative: an old column, shifted)
    in_x = src >= 0
    x_mask = c_ok[:, None] & (j_ok & in_x)[None, :]
    xv = tl.load(x_ptr + (start + src).to(tl.int64)[None, :] * stride_xt + c[:, None], mask=x_mask, other=0.0)
    state = state_ptr + slot * stride_ss + c[:, None] * stride_sc
    # the scalar flag joins the mask as a tensor (the interpreter rejects a scalar bool broadcast into a mask)
    s_mask = c_ok[:, None] & (j_ok & ~in_x & (j * 0 + init != 0))[None, :]
    old = tl.load(state + (j + (end - start))[None, :] * stride_sk, mask=s_mask, other=0.0)
    new = xv.to(tl.float32) + old.to(tl.float32)  # all loads of this (slot, channels) come before its stores
    keep = j_ok & (j * 0 + (end - start) * (1 - read_only) > 0)  # an empty sequence (padding) keeps its slot
    tl.store(state + j[None, :] * stride_sk, new.to(state_ptr.dtype.element_ty), mask=c_ok[:, None] & keep[None, :])


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
                         has_initial_state: torch.Tensor, activation: str | None = "silu",
                         read_only_state: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of kernels/gated_delta_torch.causal_conv1d_varlen: x [T, C] -> y [T, C], conv_states
    [num_slots, C, K-1] updated in place through state_indices (not for rows flagged in read_only_state)."""
    check_conv1d_inputs(x, weight, bias, conv_states, activation)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = state_indices.shape[0]
    y = torch.empty_like(x)
    if num_tokens == 0:
        return y
    positions = torch.arange(num_tokens, device=x.device, dtype=query_start_loc.dtype)
    token_seq = torch.searchsorted(query_start_loc[1:].contiguous(), positions, right=True).to(torch.int32)
    init = has_initial_state.to(torch.int8)
    keep = read_only_flags(read_only_state, num_seqs, x.device)
    grid = (triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(channels, BLOCK_C))
    causal_conv1d_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, y, token_seq, query_start_loc, state_indices,
        init, num_tokens, num_seqs, channels, x.stride(0), y.stride(0), weight.stride(0), *conv_states.stride(),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
    if num_seqs:
        conv_state_update_kernel[(num_seqs, triton.cdiv(channels, BLOCK_C))](
            x, conv_states, query_start_loc, state_indices, init, keep, channels, x.stride(0), *conv_states.stride(),
            WIDTH=width, BLOCK_K=triton.next_power_of_2(width - 1), BLOCK_C=BLOCK_C)
    return y
