"""The torch reference backend against a naive dense causal attention (per-sequence loop, no paging).

Batches come from kernels/paged_batch.py: shuffled block tables, NaN in every slot no sequence owns, the
new tokens written through write_kv_cache_torch before attention. Fresh random inputs on every run.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention_torch import paged_attention_torch, write_kv_cache_torch
from kernels.paged_batch import PagedBatch, free_blocks_behind_window, make_paged_batch

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}  # atol and rtol; fp16 inputs, fp32 oracle


def naive_attention(batch: PagedBatch, scale: float, sliding_window: int | None, soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Dense float64 attention, one sequence at a time, from the K/V each sequence stores; the sinks as
    exp(sink) added to each head's softmax denominator."""
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
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        weights = scores.masked_fill(~visible, float("-inf")).exp()
        denominator = weights.sum(-1, keepdim=True)
        if sinks is not None:
            denominator = denominator + sinks.double().exp()[:, None, None]
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", weights / denominator, v)
    return out


def run_reference(batch: PagedBatch, scale: float, sliding_window: int | None, **variants) -> torch.Tensor:
    write_kv_cache_torch(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.slot_mapping,
                         batch.k_scale, batch.v_scale)
    return paged_attention_torch(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                 batch.query_start_loc, scale, sliding_window, batch.k_scale, batch.v_scale,
                                 **variants)


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


@pytest.mark.parametrize("block_size,with_sinks", [(16, False), (4, True)], ids=["sdpa-path", "explicit-path"])
def test_window_never_reads_blocks_freed_behind_it(block_size, with_sinks):
    """Decodes and prefill chunks whose windows start blocks into their sequences: the freed entries point at
    a NaN block, so reading one would show; the result is still the dense windowed attention."""
    batch = make_paged_batch([1, 5, 1, 20], [40, 45, 9, 64], num_kv_heads=2, group=2, head_dim=32,
                             block_size=block_size)
    assert free_blocks_behind_window(batch, 11) >= 4
    variants = dict(sinks=torch.randn(4)) if with_sinks else {}
    out = run_reference(batch, 0.125, 11, **variants)
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.125, 11, **variants), atol=1e-4, rtol=1e-4)


def test_write_skips_negative_slots():
    batch = make_paged_batch([4], [4], num_kv_heads=2, group=1, head_dim=64)
    batch.slot_mapping[1] = -1
    write_kv_cache_torch(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.slot_mapping)
    flat = batch.k_cache.flatten(0, 1)
    slots = batch.slot_mapping.tolist()
    assert torch.equal(flat[slots[0]], batch.new_key[0]) and torch.equal(flat[slots[2]], batch.new_key[2])
    assert int(torch.isnan(flat).any(dim=(1, 2)).sum()) == flat.shape[0] - 3


# ---------------------------------------------------------------- variants (soft-capping, sinks)

VARIANTS = {"soft-cap": dict(soft_cap=5.0), "sinks": dict(sinks=True), "both": dict(soft_cap=5.0, sinks=True)}


def variant_args(name: str, num_heads: int) -> dict:
    """Sinks around the scores' own size (randn * 2), so they matter; a cap small enough to bend the scores
    of scale 0.5 (|s| up to ~15 on 64-dim randn)."""
    args = dict(VARIANTS[name])
    if args.get("sinks"):
        args["sinks"] = torch.randn(num_heads) * 2
    return args


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sliding_window", [None, 11])
def test_reference_variants_match_dense_attention(variant, dtype, sliding_window):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=2, head_dim=64, dtype=dtype)
    args = variant_args(variant, 4)
    out = run_reference(batch, 0.5, sliding_window, **args)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.5, sliding_window, **args), atol=tol, rtol=tol)


def test_soft_cap_changes_the_output():
    """A guard on the test above: with this cap and scale the capped attention is far from the plain one."""
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=2, head_dim=64)
    plain, capped = naive_attention(batch, 0.5, None), naive_attention(batch, 0.5, None, soft_cap=5.0)
    assert float((plain - capped).abs().max()) > 0.1


@pytest.mark.parametrize("bad,message", [(dict(soft_cap=0.0), "soft_cap 0.0"),
                                         (dict(sinks=torch.zeros(3)), r"sinks of shape \(3,\)"),
                                         (dict(sliding_window=0), "sliding_window 0")])
def test_bad_variant_arguments_are_clear_errors(bad, message):
    batch = make_paged_batch([1], [5], num_kv_heads=2, group=2, head_dim=16)
    window = bad.pop("sliding_window", None)
    with pytest.raises(ValueError, match=message):
        run_reference(batch, 0.25, window, **bad)


class EagerModule(torch.nn.Module):
    """What HF's eager attention functions read off their module."""

    def __init__(self, head_dim: int, group: int, sinks: torch.Tensor | None = None) -> None:
        super().__init__()
        self.head_dim, self.num_key_value_groups, self.sinks = head_dim, group, sinks
        self.eval()


def hf_eager(family: str, batch: PagedBatch, seq: int, scale: float, sliding_window: int | None, **variants):
    """HF's own eager attention (gemma2: scaling + softcap; gpt_oss: sinks) for sequence `seq`, with HF's
    additive causal/sliding mask built the HF way (kv_idx > q_idx - sliding_window)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager
    starts, seq_len = batch.query_start_loc.tolist(), int(batch.seq_lens[seq])
    q = batch.query[starts[seq]:starts[seq + 1]].float().transpose(0, 1)[None]
    k = batch.dense_keys[seq].float().transpose(0, 1)[None]
    v = batch.dense_values[seq].float().transpose(0, 1)[None]
    q_idx = torch.arange(seq_len - q.shape[2], seq_len)[:, None]
    kv_idx = torch.arange(seq_len)[None, :]
    allowed = (kv_idx <= q_idx) & ((kv_idx > q_idx - sliding_window) if sliding_window else True)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    group = q.shape[1] // k.shape[1]
    if family == "gemma2":
        out, _ = gemma2_eager(EagerModule(q.shape[-1], group), q, k, v, mask, scaling=scale,
                              softcap=variants.get("soft_cap"))
    else:
        out, _ = gpt_oss_eager(EagerModule(q.shape[-1], group, variants["sinks"]), q, k, v, mask, scaling=scale)
    return out[0]


@pytest.mark.parametrize("family,variant", [("gemma2", dict(soft_cap=5.0)), ("gemma2", {}),
                                            ("gpt_oss", dict(sinks=True))])
@pytest.mark.parametrize("sliding_window", [None, 11])
def test_reference_matches_hf_eager_attention(family, variant, sliding_window):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=2, head_dim=64)
    variant = dict(variant)
    if variant.get("sinks"):
        variant["sinks"] = torch.randn(4) * 2
    scale = 256 ** -0.5 if family == "gemma2" else 0.125  # Gemma's query_pre_attn_scalar, not head_dim
    out = run_reference(batch, scale, sliding_window, **variant)
    starts = batch.query_start_loc.tolist()
    for seq in range(len(MIXED[0])):
        expected = hf_eager(family, batch, seq, scale, sliding_window, **variant)
        torch.testing.assert_close(out[starts[seq]:starts[seq + 1]], expected, atol=1e-5, rtol=1e-5)
