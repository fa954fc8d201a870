"""Gemma's bidirectional attention within an image (HF's token-type mask: causal OR same image, AND the window's
lower bound on sliding layers), as per-token key limits, in the torch reference and the CPU backend against a
dense oracle; the Triton kernel is held to the torch reference in tests/test_kernels_triton.py. Also the layer's
side: it passes the step's key limits from its metadata."""
from __future__ import annotations

import pytest
import torch

from kernels.attention_cpu import paged_attention_cpu
from kernels.attention_torch import paged_attention_torch, write_kv_cache_torch
from kernels.image_mask import dense_image_mask, key_limits_for
from kernels.paged_batch import make_paged_batch

# A first prompt with an image at 3..11, a later chunk (context 20) holding an image at 22..30 and starting inside
# none, a chunk that starts inside an image (a prefix hit ending mid-image: 40..52, chunk from 44), a decode.
QUERY_LENS, SEQ_LENS = [14, 16, 12, 1], [14, 36, 56, 33]
IMAGES = [[(3, 11)], [(2, 6), (22, 30)], [(40, 52)], [(5, 9)]]


def dense_oracle(batch, scale: float, sliding_window: int | None) -> torch.Tensor:
    out, starts = [], batch.query_start_loc.tolist()
    for i, (q_len, seq_len) in enumerate(zip(QUERY_LENS, SEQ_LENS)):
        q = batch.query[starts[i]:starts[i + 1]].float().transpose(0, 1)
        group = q.shape[0] // batch.dense_keys[i].shape[1]
        k = batch.dense_keys[i].float().repeat_interleave(group, 1).transpose(0, 1)
        v = batch.dense_values[i].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~dense_image_mask(q_len, seq_len, IMAGES[i], sliding_window), float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("backend", [paged_attention_torch, paged_attention_cpu], ids=["torch", "cpu"])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_key_limits_match_the_dense_oracle(backend, sliding_window):
    torch.manual_seed(0)
    batch = make_paged_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=2, group=2, head_dim=32)
    write_kv_cache_torch(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.slot_mapping)
    limits = key_limits_for(QUERY_LENS, SEQ_LENS, IMAGES)
    got = backend(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                  batch.query_start_loc, 0.2, sliding_window, key_limits=limits)
    torch.testing.assert_close(got, dense_oracle(batch, 0.2, sliding_window).to(got.dtype), atol=1e-5, rtol=1e-5)
    causal = backend(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                     batch.query_start_loc, 0.2, sliding_window)
    assert not torch.allclose(got, causal)  # the images' earlier tokens do see their later ones


def test_the_layer_passes_the_steps_key_limits():
    from engine.layers.attention import AttentionMetadata, PagedAttention
    torch.manual_seed(1)
    batch = make_paged_batch(QUERY_LENS, SEQ_LENS, num_kv_heads=2, group=2, head_dim=32)
    layer = PagedAttention(4, 2, 32, None, scale=0.2)
    layer.bind_cache(batch.k_cache, batch.v_cache)
    meta = AttentionMetadata(batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                             max(QUERY_LENS), max(SEQ_LENS), key_limits=key_limits_for(QUERY_LENS, SEQ_LENS, IMAGES))
    got = layer(batch.query, batch.new_key, batch.new_value, meta)
    torch.testing.assert_close(got, dense_oracle(batch, 0.2, None), atol=1e-5, rtol=1e-5)
