"""PagedAttention's variant arguments (scale, soft-capping, sinks, output gate) reach the kernels as the kernel
tests check them, and the gate sits where HF's Qwen3.5 gated attention puts it.

The kernels themselves are checked elsewhere (tests/test_kernels_*.py); here the layer: its constructor
arguments, the sinks' loader under tensor parallel, and one Qwen3_5Attention from transformers against our
projections + PagedAttention(gate) on the same weights.
"""
from __future__ import annotations

import pytest
import torch

import engine.layers.attention as attention_layer
from engine.layers.attention import AttentionMetadata, PagedAttention
from kernels.attention_torch import paged_attention_torch
from kernels.paged_batch import PagedBatch, make_paged_batch


def metadata(batch: PagedBatch) -> AttentionMetadata:
    return AttentionMetadata(batch.slot_mapping, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                             int(batch.query_start_loc.diff().max()), int(batch.seq_lens.max()))


def layer_for(batch: PagedBatch, **variants) -> PagedAttention:
    heads, kv_heads, head_dim = batch.query.shape[1], batch.k_cache.shape[2], batch.query.shape[2]
    layer = PagedAttention(heads, kv_heads, head_dim, variants.pop("sliding_window", None), "torch", **variants)
    layer.bind_cache(batch.k_cache, batch.v_cache)
    return layer


@pytest.mark.parametrize("sliding_window", [None, 9])
def test_layer_passes_scale_soft_cap_and_sinks_to_the_backend(sliding_window):
    batch = make_paged_batch([1, 6, 1], [20, 30, 9], num_kv_heads=2, group=2, head_dim=32)
    layer = layer_for(batch, sliding_window=sliding_window, scale=0.3, soft_cap=6.0, use_sinks=True)
    sinks = torch.randn(4) * 2
    layer.sinks.weight_loader(layer.sinks, sinks)
    out = layer(batch.query, batch.new_key, batch.new_value, metadata(batch))
    # The layer wrote the new K/V itself; the oracle reads the same cache with the same variant arguments.
    expected = paged_attention_torch(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                     batch.query_start_loc, 0.3, sliding_window, soft_cap=6.0, sinks=sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    plain = paged_attention_torch(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                  batch.query_start_loc, 32 ** -0.5, sliding_window)
    assert float((plain - out).abs().max()) > 1e-2


def test_default_scale_is_inverse_sqrt_head_dim_and_no_variant_is_passed():
    batch = make_paged_batch([1, 4], [10, 4], num_kv_heads=1, group=2, head_dim=16)
    layer = layer_for(batch)
    seen = []
    layer.paged_attention = lambda *args, **kwargs: seen.append((args[6], kwargs)) or args[0]
    layer(batch.query, batch.new_key, batch.new_value, metadata(batch))
    assert seen == [(0.25, {})] and layer.sinks is None


def test_sinks_loader_keeps_this_ranks_heads(monkeypatch):
    monkeypatch.setattr(attention_layer, "get_tp_rank", lambda: 1)
    monkeypatch.setattr(attention_layer, "get_tp_size", lambda: 2)
    layer = PagedAttention(4, 1, 16, None, "torch", use_sinks=True)  # this rank's 4 of 8 heads
    full = torch.arange(8, dtype=torch.bfloat16)
    layer.sinks.weight_loader(layer.sinks, full)
    assert layer.sinks.dtype == torch.float32 and layer.sinks.tolist() == [4.0, 5.0, 6.0, 7.0]
    with pytest.raises(ValueError, match=r"shape \(4,\), expected \(8,\)"):
        layer.sinks.weight_loader(layer.sinks, full[:4])


def test_bad_soft_cap_is_a_clear_error():
    with pytest.raises(ValueError, match="soft_cap -1.0"):
        PagedAttention(2, 1, 16, None, "torch", soft_cap=-1.0)


def test_gate_without_metadata_keeps_the_shape():
    layer = PagedAttention(2, 1, 8, None, "torch")
    q = torch.randn(3, 2, 8)
    gate = torch.randn(3, 16)
    torch.testing.assert_close(layer(q, None, None, None, gate), q * torch.sigmoid(gate.view(3, 2, 8)))


def test_output_gate_matches_hf_qwen3_5_gated_attention():
    """HF's Qwen3_5Attention (q_proj gives [query | gate] per head; out * sigmoid(gate) before o_proj) against
    the same projections and norms feeding PagedAttention(gate=...). Rotary is the identity on both sides
    (cos 1, sin 0): RoPE is not what is tested here."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               attention_bias=False, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Qwen3_5Attention(config, layer_idx=3).eval()
    with torch.no_grad():
        hf.q_norm.weight.add_(torch.randn(16) * 0.1)
        hf.k_norm.weight.add_(torch.randn(16) * 0.1)
    tokens = 21
    x = torch.randn(1, tokens, 64)
    cos, sin = torch.ones(1, tokens, 16), torch.zeros(1, tokens, 16)
    causal = torch.full((tokens, tokens), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = hf(x, (cos, sin), causal)

        q, gate = hf.q_proj(x[0]).view(tokens, 4, 32).chunk(2, dim=-1)
        q, k = hf.q_norm(q), hf.k_norm(hf.k_proj(x[0]).view(tokens, 2, 16))
        v = hf.v_proj(x[0]).view(tokens, 2, 16)
        layer = PagedAttention(4, 2, 16, None, "torch")
        k_cache, v_cache = torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)
        layer.bind_cache(k_cache, v_cache)
        meta = AttentionMetadata(torch.arange(tokens), torch.tensor([[0, 1]], dtype=torch.int32),
                                 torch.tensor([tokens], dtype=torch.int32), torch.tensor([0, tokens], dtype=torch.int32),
                                 tokens, tokens)
        out = hf.o_proj(layer(q.contiguous(), k, v, meta, gate).reshape(tokens, 64))
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)
