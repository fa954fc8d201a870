"""The compiled CPU attention (kernels/attention_cpu.py) against the torch oracle it replaces on CPU.

Batches from kernels/paged_batch.py (shuffled blocks, NaN in every slot no sequence owns, so reading
outside a sequence's blocks shows up as NaN). Decodes go through the numba kernel or, every test again, the
native build of a float32 cache's (kernels/decode_attention.c); prefill chunks through the torch path; caches
numba cannot read fall back to the oracle whole.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention_cpu import paged_attention_cpu
from kernels.attention_torch import paged_attention_torch, write_kv_cache_torch
from kernels.paged_batch import free_blocks_behind_window, make_paged_batch

MIXED = ([1, 7, 1, 1, 20, 1], [1, 30, 45, 17, 33, 64])  # decode at position 0, decodes across blocks, chunks
NUMBA_ONLY = pytest.mark.numba_only  # a test of numba's builds themselves: run once, on numba's


@pytest.fixture(autouse=True, params=["numba", "native"])
def decode_kernel(request):
    """Every test on numba's decode kernel and on the native one (float32 caches; integer ones stay on numba's)."""
    from kernels import native_kernels

    native = request.param == "native"
    if native and request.node.get_closest_marker("numba_only"):
        pytest.skip("a test of numba's builds")
    if native and native_kernels.library() is None:
        pytest.skip("no native build here: install a C compiler (apt install gcc)")
    native_kernels.set_attention(native)
    yield request.param
    native_kernels.set_attention(True)


def both(batch, scale=0.125, sliding_window=None):
    write_kv_cache_torch(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.slot_mapping,
                         batch.k_scale, batch.v_scale)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            scale, sliding_window, batch.k_scale, batch.v_scale)
    return paged_attention_cpu(*args), paged_attention_torch(*args)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("sliding_window", [None, 11])
@pytest.mark.parametrize("block_size", [16, 8])
def test_compiled_matches_oracle(group, sliding_window, block_size):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=group, head_dim=32, block_size=block_size)
    got, expected = both(batch, sliding_window=sliding_window)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decode_only_batch_under_inference_mode():
    batch = make_paged_batch([1] * 9, [3, 200, 16, 17, 1, 64, 5, 90, 33], num_kv_heads=4, group=2, head_dim=64)
    with torch.inference_mode():
        got, expected = both(batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_non_contiguous_query_is_read_correctly():
    batch = make_paged_batch([1, 1], [20, 40], num_kv_heads=2, group=2, head_dim=16)
    batch.query = torch.cat([batch.query, batch.query], dim=-1)[..., ::2]  # a strided view, as after a split
    got, expected = both(batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float16, None), (torch.float32, torch.float8_e4m3fn)])
def test_unsupported_dtypes_fall_back_to_the_oracle(dtype, cache_dtype):
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=2, head_dim=16, dtype=dtype, cache_dtype=cache_dtype)
    got, expected = both(batch)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("variant", [dict(soft_cap=4.0), dict(sinks=True), dict(soft_cap=4.0, sinks=True)],
                         ids=["soft-cap", "sinks", "both"])
@pytest.mark.parametrize("sliding_window", [None, 11])
def test_variants_in_the_compiled_decode_match_the_oracle(variant, sliding_window):
    """Soft-capping and sinks in the numba decode loop (and in the prefill chunks it hands to torch)."""
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=3, head_dim=32)
    variant = dict(variant)
    if variant.get("sinks"):
        variant["sinks"] = torch.randn(6) * 2
    write_kv_cache_torch(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.slot_mapping)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            0.5, sliding_window)
    got, expected = paged_attention_cpu(*args, **variant), paged_attention_torch(*args, **variant)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plain = paged_attention_torch(*args)
    assert float((plain - expected).abs().max()) > 1e-2  # the variant really changes the result


def test_window_never_reads_blocks_freed_behind_it():
    """Freed entries point at a NaN block: the numba decode must start at the window, not at block 0."""
    batch = make_paged_batch(*MIXED, num_kv_heads=2, group=2, head_dim=32, block_size=8)
    assert free_blocks_behind_window(batch, 11) >= 4
    got, expected = both(batch, sliding_window=11)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@NUMBA_ONLY
@pytest.mark.parametrize("min_work", [0, 1 << 40], ids=["parallel", "serial"])
def test_serial_and_parallel_builds_both_match_the_oracle(monkeypatch, min_work):
    """Small decode batches run the kernel on the calling thread, large ones on numba's pool: same results."""
    import kernels.attention_cpu as attention_cpu
    monkeypatch.setattr(attention_cpu, "PARALLEL_MIN_WORK", min_work)
    calls = []
    for name in ("_decode_kernel", "_decode_serial"):
        kernel = getattr(attention_cpu, name)
        monkeypatch.setattr(attention_cpu, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    batch = make_paged_batch([1] * 5, [3, 40, 17, 64, 9], num_kv_heads=2, group=2, head_dim=32)
    got, expected = both(batch, sliding_window=11)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    want = "_decode_serial" if min_work or attention_cpu.numba.get_num_threads() == 1 else "_decode_kernel"
    assert calls == [want]


@NUMBA_ONLY
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_start_compiles_the_decode_kernel_for_its_caches(llama_dir, kv_cache_dtype):
    """The engine compiles both builds for its layers' cache arrays (a view of the block pool; int8 with scale
    arrays) while it starts: the first requests' decodes, serial and parallel, compile nothing more."""
    import numba

    import kernels.attention_cpu as attention_cpu
    from engine.entrypoints.llm import LLM
    from engine.layers.attention import PagedAttention
    from engine.sample.sampling_params import SamplingParams

    llm = LLM(str(llama_dir), device="cpu", kv_cache_dtype=kv_cache_dtype, max_model_len=96)
    kernels = (attention_cpu._decode_kernel, attention_cpu._decode_serial)
    cache = next(m for m in llm.engine.runner.model.modules() if isinstance(m, PagedAttention)).k_cache
    for kernel in kernels:
        assert any(numba.typeof(cache.numpy()) in signature for signature in kernel.signatures)
    compiled = [list(kernel.signatures) for kernel in kernels]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for min_work in (1 << 40, 0):
        attention_cpu.PARALLEL_MIN_WORK, saved = min_work, attention_cpu.PARALLEL_MIN_WORK
        try:
            llm.generate([[5, 6, 7], [8, 9]], params)
        finally:
            attention_cpu.PARALLEL_MIN_WORK = saved
    assert [list(kernel.signatures) for kernel in kernels] == compiled


@pytest.mark.parametrize("per_item", [1, 2, 3])
def test_runs_of_kv_heads_per_work_item_match_the_oracle(monkeypatch, per_item):
    """A sequence's KV heads in one work item or split into runs (an uneven last run too): same results."""
    import kernels.attention_cpu as attention_cpu
    assert attention_cpu.heads_per_item(4, 1, 2) == 1 and attention_cpu.heads_per_item(4, 8, 2) == 4
    assert attention_cpu.heads_per_item(4, 8, 1) == 4
    monkeypatch.setattr(attention_cpu, "heads_per_item", lambda kv_heads, seqs, threads: per_item)
    monkeypatch.setattr(attention_cpu, "PARALLEL_MIN_WORK", 0)
    batch = make_paged_batch([1] * 3, [5, 40, 17], num_kv_heads=3, group=2, head_dim=16)
    got, expected = both(batch, sliding_window=11)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [([1] * 5, [3, 17, 40, 1, 64]), MIXED], ids=["decodes", "mixed"])
@pytest.mark.parametrize("cache_dtype", [None, torch.int8], ids=["float32", "int8"])
def test_new_kv_written_by_the_kernel_equals_writing_first(lens, cache_dtype):
    """`new_kv`: the step's keys and values written by the kernel (the native one in its own chunks for a step of
    decodes into a float32 cache; else the torch write first) leave the same caches and give the same output as the
    write before the call. Keys and values are views of one projection output, as the layers split it."""
    from kernels.attention_cpu import step_layout

    batch = make_paged_batch(*lens, num_kv_heads=2, group=2, head_dim=16, cache_dtype=cache_dtype)
    heads, kv_heads, dim = batch.query.shape[1], batch.new_key.shape[1], batch.new_key.shape[2]
    qkv = torch.cat([t.flatten(1) for t in (batch.query, batch.new_key, batch.new_value)], dim=1)
    _, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    caches = [t.clone() for t in (batch.k_cache, batch.v_cache)]
    scales = [t.clone() if isinstance(t, torch.Tensor) else t for t in (batch.k_scale, batch.v_scale)]
    layout = step_layout(batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.slot_mapping)
    got = paged_attention_cpu(batch.query, *caches, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.125,
                              None, *scales, layout=layout,
                              new_kv=(k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)))
    expected, oracle = both(batch)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, oracle, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(caches + scales, [batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale]):
        if isinstance(mine, torch.Tensor):
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))  # NaN in unowned slots: bytes


def test_new_kv_needs_the_layouts_slots():
    batch = make_paged_batch([1], [5], num_kv_heads=1, group=1, head_dim=8)
    with pytest.raises(ValueError, match="slots"):
        paged_attention_cpu(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                            batch.query_start_loc, 0.125, new_kv=(batch.new_key, batch.new_value))
