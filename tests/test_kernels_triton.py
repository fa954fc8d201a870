"""Triton kernels against the torch reference, run on CPU by the Triton interpreter.

`triton.jit` picks compiled or interpreted when a function is decorated, and triton's own library
functions (tl.cdiv, tl.sum, ...) are decorated when triton is first imported. So TRITON_INTERPRET=1 is
set here before the first import of triton (and left set: on CPU nothing else can run Triton anyway).
If another test module imported triton earlier in this process, the tests below are skipped and
`test_whole_module_in_a_fresh_process` reruns this file in a subprocess instead. Shapes stay tiny (the
interpreter is slow per program instance). bf16 is not tested: `tl.dot` on bf16 is wrong in the
interpreter. Tolerances (atol = rtol): fp32 1e-4, fp16 2e-3. Fresh random inputs on every run.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402  (everything below may import triton)
import torch  # noqa: E402
from interpreted import fresh_process_tests  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels import triton_attention, triton_fp8  # noqa: E402
from kernels.attention_torch import paged_attention_torch, write_kv_cache_torch  # noqa: E402
from kernels.paged_batch import PagedBatch, free_blocks_behind_window, make_paged_batch  # noqa: E402
from kernels.triton_paged_attention import paged_attention_kernel  # noqa: E402

IN_INTERPRETER = isinstance(tl.standard.sum, InterpretedFunction) and isinstance(paged_attention_kernel,
                                                                                  InterpretedFunction)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3}
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@triton.jit
def decode_fp8_kernel(byte_ptr, out_ptr, n, FP8_FORMAT: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bytes_ = tl.load(byte_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, triton_fp8.fp8_to_float(bytes_, FP8_FORMAT), mask=offsets < n)


@triton.jit
def encode_fp8_kernel(x_ptr, out_ptr, n, MAN_BITS: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
                      BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, triton_fp8.float_to_fp8(x, MAN_BITS, BIAS, FP8_MAX), mask=offsets < n)


test_whole_module_in_a_fresh_process, skip_unless_interpreted = fresh_process_tests(__file__, IN_INTERPRETER)


def test_kernels_run_in_the_interpreter():
    assert isinstance(triton_attention.write_kv_cache_triton.__globals__["write_kv_kernel"], InterpretedFunction)


# ---------------------------------------------------------------- FP8 bit codecs

def decode_bytes(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(codes.numel(), dtype=torch.float32)
    decode_fp8_kernel[(triton.cdiv(codes.numel(), 4096),)](codes, out, codes.numel(),
                                                         triton_fp8.FP8_FORMATS[dtype].code, BLOCK=4096)
    return out


def encode_floats(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmt = triton_fp8.FP8_FORMATS[dtype]
    out = torch.empty(x.numel(), dtype=torch.uint8)
    encode_fp8_kernel[(triton.cdiv(x.numel(), 4096),)](x, out, x.numel(), fmt.man_bits, fmt.bias, fmt.max,
                                                     BLOCK=4096)
    return out


def torch_encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype).view(torch.uint8)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_decode_matches_torch_for_all_256_bytes(dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    got, want = decode_bytes(codes, dtype), codes.view(dtype).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])  # exact, infinities included
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))  # -0.0 too


def encode_probe_values(dtype: torch.dtype) -> torch.Tensor:
    """Every fp8 value, the midpoints between neighbours (ties to even) and one fp32 ulp either side of
    them, values past the finite range, specials, and random values over the whole exponent range."""
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)].unique()  # sorted, one zero
    mids = (grid[1:] + grid[:-1]) / 2
    ulp_side = torch.cat([torch.nextafter(mids, torch.tensor(float("inf"))),
                          torch.nextafter(mids, torch.tensor(float("-inf")))])
    limit = torch.finfo(dtype).max
    specials = torch.tensor([0.0, -0.0, limit * 1.01, -limit * 4, float("inf"), float("-inf"), 1e-45, -1e-40,
                             torch.finfo(dtype).smallest_normal / 3])
    random = torch.randn(20000) * torch.exp2(torch.randint(-24, 18, (20000,)).float())
    return torch.cat([grid, mids, ulp_side, specials, random])


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_encode_matches_torch_cast_after_saturation(dtype):
    x = encode_probe_values(dtype)
    got, want = encode_floats(x, dtype), torch_encode(x, dtype)
    bad = (got != want).nonzero().flatten()[:5]
    assert bad.numel() == 0, f"{dtype}: x={x[bad].tolist()} got={got[bad].tolist()} want={want[bad].tolist()}"


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_encode_nan_keeps_sign(dtype):
    got = encode_floats(torch.tensor([float("nan"), -float("nan")]), dtype)
    assert got.tolist() == [0x7F, 0xFF]


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_round_trip_error_is_at_most_half_an_ulp(dtype):
    """RNE in the normal range: relative error <= 2^-(mantissa bits + 1), i.e. 2^-4 for e4m3, 2^-3 for e5m2
    (tighter than the 2^-3 / 2^-2 a careless rounding would still meet)."""
    fmt = triton_fp8.FP8_FORMATS[dtype]
    tiny = torch.finfo(dtype).smallest_normal
    x = torch.sign(torch.randn(20000)) * torch.exp(torch.empty(20000).uniform_(float(torch.tensor(tiny).log()),
                                                                              float(torch.tensor(fmt.max).log())))
    back = decode_bytes(encode_floats(x, dtype), dtype)
    assert float(((back - x).abs() / x.abs()).max()) <= 2.0 ** -(fmt.man_bits + 1)


# ---------------------------------------------------------------- KV write

@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, *FP8])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_matches_torch_bytes(cache_dtype, slot_dtype):
    batch = make_paged_batch([5, 12], [20, 12], num_kv_heads=2, group=1, head_dim=64, cache_dtype=cache_dtype)
    batch.slot_mapping[3] = -1
    qkv = torch.randn(batch.new_key.shape[0], 3, 2, 64)  # key/value as strided views, as a fused qkv makes them
    key, value = qkv[:, 1], qkv[:, 2]
    scale = torch.tensor(0.5) if cache_dtype in FP8 else None
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv_cache_torch(key, value, expected_k, expected_v, batch.slot_mapping, scale, scale)
    triton_attention.write_kv_cache_triton(key, value, batch.k_cache, batch.v_cache,
                                           batch.slot_mapping.to(slot_dtype), scale, scale)
    assert torch.equal(batch.k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(batch.v_cache.view(torch.uint8), expected_v.view(torch.uint8))


# ---------------------------------------------------------------- attention

def run_both(batch: PagedBatch, sliding_window=None, tiles=None, scale=0.125, **variants):
    """Write the new tokens and attend with each backend on its own copy of the cache; caches must agree.
    `variants`: soft_cap / sinks, passed to both."""
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv_cache_torch(batch.new_key, batch.new_value, k_ref, v_ref, batch.slot_mapping,
                         batch.k_scale, batch.v_scale)
    expected = paged_attention_torch(batch.query, k_ref, v_ref, batch.block_tables, batch.seq_lens,
                                     batch.query_start_loc, scale, sliding_window, batch.k_scale, batch.v_scale,
                                     **variants)
    triton_attention.write_kv_cache_triton(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache,
                                           batch.slot_mapping, batch.k_scale, batch.v_scale)
    assert torch.equal(batch.k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            scale, sliding_window, batch.k_scale, batch.v_scale)
    if tiles is None:
        got = triton_attention.paged_attention_triton(*args, **variants)
    else:
        got = triton_attention.launch_paged_attention(*args, tiles, **variants)
    return got, expected


def assert_matches(got, expected, dtype):
    for name, out in (("torch reference", expected), ("Triton", got)):
        bad_tokens = (~torch.isfinite(out)).flatten(1).any(1).nonzero().flatten().tolist()
        assert not bad_tokens, f"{name} output is not finite for tokens {bad_tokens}"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


DECODE = ([1, 1, 1], [1, 37, 64])  # no context at all, mid-block, exactly four blocks
MIXED = ([1, 6, 1, 18], [21, 40, 50, 18])  # decodes, a chunk after context, a whole first prompt


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_batch(group, head_dim):
    batch = make_paged_batch(*DECODE, num_kv_heads=2, group=group, head_dim=head_dim)
    assert_matches(*run_both(batch), torch.float32)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_prefill_and_decode_batch(group, dtype):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=group, head_dim=64, dtype=dtype)
    assert_matches(*run_both(batch), dtype)


def test_mixed_batch_head_dim_128_fp16():
    batch = make_paged_batch(*MIXED, num_kv_heads=1, group=4, head_dim=128, dtype=torch.float16)
    assert_matches(*run_both(batch), torch.float16)


@pytest.mark.parametrize("tiles", [(16, 1, 16, 1), (16, 4, 16, 1), (32, 8, 32, 2)],
                         ids=["token-per-program", "four-tokens", "split2"])
def test_mixed_batch_tile_and_split_variants(tiles):
    batch = make_paged_batch(*MIXED, num_kv_heads=1, group=4, head_dim=64)
    assert_matches(*run_both(batch, tiles=triton_attention.AttentionTiles(*tiles)), torch.float32)


def test_decode_split_four_ways():
    batch = make_paged_batch(*DECODE, num_kv_heads=2, group=2, head_dim=64)
    assert_matches(*run_both(batch, tiles=triton_attention.AttentionTiles(16, 1, 16, 4)), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window(num_splits):
    batch = make_paged_batch([1, 9, 1], [60, 45, 7], num_kv_heads=2, group=2, head_dim=64)
    tiles = triton_attention.AttentionTiles(16, 8, 16, num_splits)
    assert_matches(*run_both(batch, sliding_window=19, tiles=tiles), torch.float32)


def test_window_never_reads_blocks_freed_behind_it():
    """Table entries behind each window point at a NaN block (freed, as a window group does); with 32-token
    tiles over 8-token blocks the first tile starts blocks before the window, and must not read them."""
    batch = make_paged_batch([1, 9, 1], [60, 45, 30], num_kv_heads=1, group=2, head_dim=64, block_size=8)
    assert free_blocks_behind_window(batch, 19) >= 6
    assert_matches(*run_both(batch, sliding_window=19, tiles=triton_attention.AttentionTiles(16, 8, 32, 1)),
                   torch.float32)


def test_long_decode_split_by_default_heuristic():
    batch = make_paged_batch([1], [600], num_kv_heads=1, group=2, head_dim=64)
    tiles = triton_attention.choose_tiles(1, 1, 1, 2, 64, batch.block_tables.shape[1] * 16, torch.device("cpu"))
    assert tiles.num_splits > 1 and tiles.block_q == 1
    assert_matches(*run_both(batch), torch.float32)


def test_odd_group_and_non_power_of_two_head_dim():
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=3, head_dim=80, dtype=torch.float16)
    assert_matches(*run_both(batch), torch.float16)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache(cache_dtype, dtype):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=2, head_dim=64, dtype=dtype, cache_dtype=cache_dtype)
    assert_matches(*run_both(batch, sliding_window=25 if dtype == torch.float16 else None), dtype)


def test_int64_metadata_and_a_sequence_without_new_tokens():
    batch = make_paged_batch([3, 0, 1], [19, 33, 40], num_kv_heads=2, group=2, head_dim=64)
    batch.block_tables, batch.seq_lens = batch.block_tables.long(), batch.seq_lens.long()
    batch.query_start_loc = batch.query_start_loc.long()
    assert_matches(*run_both(batch), torch.float32)


def test_empty_batch_returns_empty():
    batch = make_paged_batch([1], [5], num_kv_heads=1, group=1, head_dim=64)
    out = triton_attention.paged_attention_triton(batch.query[:0], batch.k_cache, batch.v_cache,
                                                  batch.block_tables[:0], batch.seq_lens[:0],
                                                  batch.query_start_loc[:1], 0.125)
    assert out.shape == (0, 1, 64)


# ---------------------------------------------------------------- variants: soft-capping and sinks

def sinks_for(batch: PagedBatch, dtype=torch.float32) -> torch.Tensor:
    """Per-head sinks around the scores' size, so they move the result (gpt-oss checkpoints hold bf16)."""
    return (torch.randn(batch.query.shape[1]) * 2).to(dtype)


DTYPE_AND_SPLITS = [(torch.float32, 4), (torch.float16, 1)]  # the interpreter is slow: two of the four pairs


@pytest.mark.parametrize("dtype,num_splits", DTYPE_AND_SPLITS)
def test_soft_cap(dtype, num_splits):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=2, head_dim=64, dtype=dtype)
    tiles = triton_attention.AttentionTiles(16, 8, 16, num_splits)
    got, expected = run_both(batch, tiles=tiles, scale=0.5, soft_cap=5.0)
    assert_matches(got, expected, dtype)
    plain = paged_attention_torch(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                  batch.query_start_loc, 0.5)
    assert float((plain.float() - got.float()).abs().max()) > 0.05  # the cap bends these scores


def test_soft_cap_saturates_without_nan():
    """Scores of ~1e4: tanh must saturate to ±1, not turn into inf/inf."""
    batch = make_paged_batch([1, 6], [9, 20], num_kv_heads=1, group=2, head_dim=64)
    batch.query *= 300
    assert_matches(*run_both(batch, scale=1.0, soft_cap=30.0), torch.float32)


@pytest.mark.parametrize("dtype,num_splits", DTYPE_AND_SPLITS)
def test_sinks(dtype, num_splits):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=2, head_dim=64, dtype=dtype)
    tiles = triton_attention.AttentionTiles(16, 8, 16, num_splits)
    assert_matches(*run_both(batch, tiles=tiles, sinks=sinks_for(batch, dtype)), dtype)


@pytest.mark.parametrize("sliding_window", [None, 150])
def test_sinks_in_a_decode_split_four_ways(sliding_window):
    """Decode-only, split flash-decoding style: the sink must count once (in split 0), also where a split has
    nothing to read (the 40-token sequence has three tiles for four splits)."""
    batch = make_paged_batch([1, 1], [300, 40], num_kv_heads=1, group=2, head_dim=64)
    tiles = triton_attention.AttentionTiles(16, 1, 16, 4)
    assert_matches(*run_both(batch, sliding_window, tiles, sinks=sinks_for(batch)), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_soft_cap_sinks_window_and_fp8_together(dtype):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=3, head_dim=80, dtype=dtype,
                             cache_dtype=torch.float8_e4m3fn)
    assert_matches(*run_both(batch, sliding_window=13, scale=0.4, soft_cap=8.0, sinks=sinks_for(batch)), dtype)


@pytest.mark.parametrize("sliding_window,tiles", [(None, None), (6, None), (None, (16, 4, 16, 2))],
                         ids=["full", "window", "four-tokens-split2"])
def test_image_key_limits(sliding_window, tiles):
    """Gemma's bidirectional attention within an image (tests/test_image_attention_mask.py holds the torch
    reference to HF's dense mask): the same key limits, the same output."""
    from kernels.image_mask import key_limits_for
    query_lens, seq_lens = [14, 16, 12, 1], [14, 36, 56, 33]
    images = [[(3, 11)], [(2, 6), (22, 30)], [(40, 52)], [(5, 9)]]
    batch = make_paged_batch(query_lens, seq_lens, num_kv_heads=1, group=4, head_dim=64)
    limits = key_limits_for(query_lens, seq_lens, images)
    tiles = None if tiles is None else triton_attention.AttentionTiles(*tiles)
    assert_matches(*run_both(batch, sliding_window, tiles, key_limits=limits), torch.float32)
