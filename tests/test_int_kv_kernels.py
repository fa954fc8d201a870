"""Integer KV caches (int8, int4 packed two to a byte, fp32 scales per group of a token's head) in every backend: the
torch reference's round trip within half a step, the Triton KV write byte for byte equal to the torch one, and
Triton and the numba CPU decode against the torch reference, all run on CPU (Triton interpreted, as in
tests/test_kernels_triton.py: tiny shapes, fp32 and fp16 queries, never bf16).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402  (everything below may import triton)
import torch  # noqa: E402
from interpreted import fresh_process_tests  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels import triton_attention  # noqa: E402
from kernels.attention_torch import paged_attention_torch, write_kv_cache_torch  # noqa: E402
from kernels.kv_int_torch import QMAX, dequantize_int, quantize_int  # noqa: E402
from kernels.paged_batch import make_paged_batch  # noqa: E402
from kernels.triton_paged_attention import paged_attention_kernel  # noqa: E402

IN_INTERPRETER = isinstance(tl.standard.sum, InterpretedFunction) and isinstance(paged_attention_kernel,
                                                                                  InterpretedFunction)
INT_KV = {"int8": torch.int8, "int4": torch.uint8}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}
MIXED = ([1, 6, 1, 18], [21, 40, 50, 18])  # decodes, a chunk after context, a whole first prompt

test_whole_module_in_a_fresh_process, skip_unless_interpreted = fresh_process_tests(__file__, IN_INTERPRETER)


@pytest.mark.parametrize("name,group", [("int8", 64), ("int4", 16), ("int4", 64)])
def test_round_trip_error_is_at_most_half_a_step(name, group):
    dtype = INT_KV[name]
    x = torch.randn(50, 4, 64) * torch.exp2(torch.randint(-6, 6, (50, 4, 1)).float())
    x[3, 1] = 0.0  # an all-zero head: scale 1, values 0
    values, scales = quantize_int(x, dtype, group)
    assert values.dtype == dtype and values.shape[-1] == 64 // (2 if name == "int4" else 1)
    assert scales.shape == (50, 4, 64 // group) and scales[3, 1].eq(1).all()
    back = dequantize_int(values, scales, torch.float32)
    step = scales.repeat_interleave(group, -1)
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()
    # The group's largest value is exactly representable at ±qmax steps (it sets the scale).
    amax = x.unflatten(-1, (64 // group, group)).abs().amax(-1)
    assert torch.allclose(scales, torch.where(amax > 0, amax / QMAX[dtype], torch.ones_like(amax)))


@pytest.mark.parametrize("name", list(INT_KV))
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_triton_write_matches_torch_bytes(name, slot_dtype):
    batch = make_paged_batch([5, 12], [20, 12], num_kv_heads=2, group=1, head_dim=64, cache_dtype=INT_KV[name])
    batch.slot_mapping[3] = -1
    qkv = torch.randn(batch.new_key.shape[0], 3, 2, 64)  # key/value as strided views, as a fused qkv makes them
    key, value = qkv[:, 1] * 3, qkv[:, 2]
    expected = [t.clone() for t in (batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale)]
    write_kv_cache_torch(key, value, *expected[:2], batch.slot_mapping, *expected[2:])
    triton_attention.write_kv_cache_triton(key, value, batch.k_cache, batch.v_cache, batch.slot_mapping.to(slot_dtype),
                                           batch.k_scale, batch.v_scale)
    for got, want in zip((batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale), expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def run_both(batch, sliding_window=None, scale=0.125, tiles=None):
    refs = [t.clone() for t in (batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale)]
    write_kv_cache_torch(batch.new_key, batch.new_value, refs[0], refs[1], batch.slot_mapping, refs[2], refs[3])
    expected = paged_attention_torch(batch.query, refs[0], refs[1], batch.block_tables, batch.seq_lens,
                                     batch.query_start_loc, scale, sliding_window, refs[2], refs[3])
    triton_attention.write_kv_cache_triton(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache,
                                           batch.slot_mapping, batch.k_scale, batch.v_scale)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            scale, sliding_window, batch.k_scale, batch.v_scale)
    got = triton_attention.paged_attention_triton(*args) if tiles is None else \
        triton_attention.launch_paged_attention(*args, tiles)
    return got, expected


@pytest.mark.parametrize("name", list(INT_KV))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_attention_matches_torch_on_a_mixed_batch(name, dtype):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=2, head_dim=64, dtype=dtype, cache_dtype=INT_KV[name])
    got, expected = run_both(batch, sliding_window=25 if dtype == torch.float16 else None)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("name,int_group", [("int8", 32), ("int4", 32)])
def test_triton_decode_split_with_several_scales_per_head(name, int_group):
    batch = make_paged_batch([1, 1, 1], [1, 37, 64], num_kv_heads=2, group=2, head_dim=64,
                             cache_dtype=INT_KV[name], int_group=int_group)
    got, expected = run_both(batch, tiles=triton_attention.AttentionTiles(16, 1, 16, 2))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(INT_KV))
def test_numba_cpu_decode_matches_torch(name):
    from kernels.attention_cpu import paged_attention_cpu
    batch = make_paged_batch([1, 1, 1, 7], [1, 37, 64, 30], num_kv_heads=2, group=2, head_dim=32,
                             cache_dtype=INT_KV[name], int_group=16)
    write_kv_cache_torch(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.slot_mapping,
                         batch.k_scale, batch.v_scale)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            0.125, None, batch.k_scale, batch.v_scale)
    torch.testing.assert_close(paged_attention_cpu(*args), paged_attention_torch(*args), atol=1e-5, rtol=1e-5)
    window = paged_attention_cpu(*args[:7], 20, *args[8:])
    torch.testing.assert_close(window, paged_attention_torch(*args[:7], 20, *args[8:]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(INT_KV))
def test_attention_reads_what_the_dense_oracle_reads(name):
    """The reference's paged read equals plain attention over the dense, round-tripped K/V (per sequence)."""
    batch = make_paged_batch([1, 9], [30, 9], num_kv_heads=1, group=2, head_dim=32, cache_dtype=INT_KV[name])
    write_kv_cache_torch(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.slot_mapping,
                         batch.k_scale, batch.v_scale)
    out = paged_attention_torch(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                batch.query_start_loc, 0.125, None, batch.k_scale, batch.v_scale)
    starts = batch.query_start_loc.tolist()
    for i, (k, v) in enumerate(zip(batch.dense_keys, batch.dense_values)):
        q = batch.query[starts[i]:starts[i + 1]]
        seq_len, q_len = k.shape[0], q.shape[0]
        mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(2, 0), v.transpose(0, 1).repeat_interleave(2, 0),
            attn_mask=mask, scale=0.125).transpose(0, 1)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], want, atol=1e-5, rtol=1e-5)
