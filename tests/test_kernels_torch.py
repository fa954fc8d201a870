"""The torch reference backend against a naive dense causal attention (per-sequence loop, no paging).

Batches come from kernels/paged_batch.py: shuffled block tables, NaN in every slot no sequence owns, the
new tokens written through write_kv_cache_torch before attention. Fresh random inputs on every run.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention_torch import paged_attention_torch, write_kv_cache_torch
from kernels.paged_batch import PagedBatch, make_paged_batch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}  # atol and rtol; fp16 inputs, fp32 oracle


def naive_attention(batch: PagedBatch, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Dense float64 attention, one sequence at a time, from the K/V each sequence stores."""
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        q = batch.query[starts[i]:starts[i + 1]].double()
        group = q.shape[1] // batch.dense_keys[i].shape[1]
        k = batch.dense_keys[i].double().repeat_interleave(group, dim=1)
        v = batch.dense_values[i].double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def run_reference(batch: PagedBatch, scale: float, sliding_window: int | None) -> torch.Tensor:
    write_kv_cache_torch(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.slot_mapping,
                         batch.k_scale, batch.v_scale)
    return paged_attention_torch(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                 batch.query_start_loc, scale, sliding_window, batch.k_scale, batch.v_scale)


MIXED = ([1, 7, 1, 20, 16], [1, 30, 45, 33, 16])  # decode without context, chunks mid-block, a whole prompt


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sliding_window", [None, 11])
def test_reference_matches_dense_attention(group, dtype, sliding_window):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=group, head_dim=64, dtype=dtype)
    out = run_reference(batch, 0.125, sliding_window)
    expected = naive_attention(batch, 0.125, sliding_window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reference_fp8_cache_matches_dense_attention_on_stored_values(cache_dtype):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=2, head_dim=64, cache_dtype=cache_dtype)
    out = run_reference(batch, 0.125, None)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.125, None), atol=1e-4, rtol=1e-4)


def test_decode_ignores_unused_block_table_entries_and_nan_padding():
    batch = make_paged_batch([1, 1, 1], [3, 40, 17], num_kv_heads=1, group=4, head_dim=64)
    assert int(batch.block_tables.max()) >= batch.k_cache.shape[0]  # the filler id is out of range
    out = run_reference(batch, 0.125, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.125, None), atol=1e-4, rtol=1e-4)


def test_write_skips_negative_slots():
    batch = make_paged_batch([4], [4], num_kv_heads=2, group=1, head_dim=64)
    batch.slot_mapping[1] = -1
    write_kv_cache_torch(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.slot_mapping)
    flat = batch.k_cache.flatten(0, 1)
    slots = batch.slot_mapping.tolist()
    assert torch.equal(flat[slots[0]], batch.new_key[0]) and torch.equal(flat[slots[2]], batch.new_key[2])
    assert int(torch.isnan(flat).any(dim=(1, 2)).sum()) == flat.shape[0] - 3
