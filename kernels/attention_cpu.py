"""Compiled CPU decode attention that reads K/V in place from the block pool (numba, parallel over sequences, and
over runs of KV heads when there are fewer sequences than threads): no per-step gather of every sequence's context,
no padding.

Same signature and results (to float tolerance) as `kernels.attention_torch.paged_attention_torch`, which
stays the oracle. One-token queries (decodes) run here; prefill chunks keep the torch path (one SDPA call
per chunk, where the gather is paid once per chunk). Integer caches (int8, packed int4) are read in place too, each
value times its group's scale (`_kv`, resolved per cache dtype when numba compiles, so the float32 path carries
none of it). Caches numba cannot read (FP8, bfloat16) and non-float32 queries fall back to the oracle whole. Numba
was chosen over torch.compile by measurement (BENCHMARKS.md): inductor still materialises the gathered context and
recompiles as batch shapes change. A float32 cache's decodes run the native build instead
(kernels/decode_attention.c: the same two passes with SIMD dots, on the thread pool the native linears use, called
on raw addresses) where a C compiler built it and `native_kernels.set_attention` left it on.
Imports nothing of ours outside kernels/; runs on the pool kernels/numba_pool.py picks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba.extending import overload

from kernels.attention_torch import check_variants, paged_attention_torch, prefill_attention_torch, write_kv_cache_torch
from kernels.kv_int_torch import is_int_kv
from kernels.native_kernels import attention_enabled, library as native_library
from kernels.numba_pool import renamed  # also picks the pool numba's parallel kernels run on


def _kv(cache, scales, blk, off, head, d):  # pragma: no cover - only ever compiled, through the overload below
    """Value d of (block, offset, head) of a cache as float32."""
    raise NotImplementedError


@overload(_kv, inline="always")
def _kv_for(cache, scales, blk, off, head, d):
    """float32: the value; int8: times its group's scale; uint8 (packed int4): its nibble, sign-extended, times it."""
    if cache.dtype == numba.types.int8:
        def int8_value(cache, scales, blk, off, head, d):
            return np.float32(cache[blk, off, head, d]) * scales[blk, off, head, d // (cache.shape[3] // scales.shape[3])]
        return int8_value
    if cache.dtype == numba.types.uint8:
        def int4_value(cache, scales, blk, off, head, d):
            nibble = (np.int32(cache[blk, off, head, d >> 1]) >> ((d & 1) * 4)) & 15
            group = 2 * cache.shape[3] // scales.shape[3]
            return np.float32((nibble ^ 8) - 8) * scales[blk, off, head, d // group]
        return int4_value

    def float_value(cache, scales, blk, off, head, d):
        return cache[blk, off, head, d]
    return float_value


_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
# A decode batch smaller than this many multiply-adds runs on the calling thread: waking numba's pool costs more
# than it saves (tens of microseconds; far more when torch's OpenMP threads hold the cores), and small batches
# are the latency-bound ones.
PARALLEL_MIN_WORK = 1 << 20


def _decode(query, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, rows, scale, window, soft_cap,
            sinks, heads_per_item, out):  # pragma: no cover
    """out[rows[s], h] = softmax(q·Kᵀ·scale) V over the last min(seq_len, window) tokens of sequence s.

    One work item per (sequence, run of `heads_per_item` KV heads), two passes over its tokens in cache order:
    scores for every query head of the run (each K row read once for the heads sharing it), then the weighted sum
    of V rows. Token-major on purpose: a token's heads lie side by side in a block, so the item reads its K and
    V as contiguous runs the hardware prefetcher follows; a head-major walk (every token's slice of one head,
    then the next head) strides through the block and, with the cache cold after the step's weights streamed
    through it, ran 4-7x slower. soft_cap 0 means none; an empty `sinks` means none, else sinks[h] is one more
    logit of head h in the denominator. `k_scales` and `v_scales`: an integer cache's scales (unused for a
    float32 cache)."""
    num_seqs = rows.shape[0]
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], query.shape[2]
    group = query.shape[1] // num_kv_heads
    runs = (num_kv_heads + heads_per_item - 1) // heads_per_item
    for work in numba.prange(num_seqs * runs):
        s, run = work // runs, work % runs
        kv_first = run * heads_per_item
        kv_last = min(num_kv_heads, kv_first + heads_per_item)
        h_first, h_count = kv_first * group, (kv_last - kv_first) * group
        row, seq_len = rows[s], seq_lens[s]
        first = max(0, seq_len - window)
        n = seq_len - first
        scores = np.empty((h_count, n), dtype=np.float32)
        for t in range(n):
            pos = first + t
            blk, off = block_tables[s, pos // block_size], pos % block_size
            for kvh in range(kv_first, kv_last):
                for g in range(group):
                    h = kvh * group + g
                    acc = np.float32(0.0)
                    for d in range(head_dim):
                        acc += query[row, h, d] * _kv(k_cache, k_scales, blk, off, kvh, d)
                    score = acc * scale
                    if soft_cap > 0:
                        score = np.float32(np.tanh(score / soft_cap)) * soft_cap
                    scores[h - h_first, t] = score
        for i in range(h_count):
            m = scores[i].max()
            total = np.float32(0.0)
            if sinks.shape[0] > 0:
                sink = sinks[h_first + i]
                m = max(m, sink)
                total = np.float32(np.exp(sink - m))
            for t in range(n):
                e = np.exp(scores[i, t] - m)
                scores[i, t] = e
                total += e
            inv = np.float32(1.0) / total
            for t in range(n):
                scores[i, t] *= inv
        acc_out = np.zeros((h_count, head_dim), dtype=np.float32)
        for t in range(n):
            pos = first + t
            blk, off = block_tables[s, pos // block_size], pos % block_size
            for kvh in range(kv_first, kv_last):
                for g in range(group):
                    h = kvh * group + g
                    p = scores[h - h_first, t]
                    for d in range(head_dim):
                        acc_out[h - h_first, d] += p * _kv(v_cache, v_scales, blk, off, kvh, d)
        for i in range(h_count):
            for d in range(head_dim):
                out[row, h_first + i, d] = acc_out[i, d]


_decode_kernel = numba.njit(parallel=True, cache=True, fastmath=_FASTMATH)(_decode)
# The serial build's prange is a range. Both keep the GIL (kernels/native_build.py says why).
_decode_serial = numba.njit(cache=True, fastmath=_FASTMATH)(renamed(_decode, "_decode_serial"))

_native_kernel = None  # the loaded function, False where there is no native build
_thread_count = None  # numba's pool size, fixed once its pool starts (the thread budget's NUMBA_NUM_THREADS)


def pool_threads() -> int:
    """The kernels' thread count: numba's pool size, which the native pool takes too."""
    global _thread_count
    if _thread_count is None:
        _thread_count = numba.get_num_threads()
    return _thread_count


def _native_decode(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: np.ndarray):
    """The native kernel where it can read these caches and tables: float32, the same strides, contiguous head
    dims, int32 tables; else None (numba's runs)."""
    global _native_kernel
    if not attention_enabled() or k_cache.dtype != torch.float32 or k_cache.stride() != v_cache.stride() or \
            k_cache.stride(3) != 1 or tables.dtype != np.int32 or not tables.flags.c_contiguous:
        return None
    if _native_kernel is None:
        library = native_library()
        _native_kernel = False if library is None else library.pagedesk_decode_attention
    return _native_kernel or None


_NO_SINKS = np.empty(0, dtype=np.float32)
_NO_SCALES = np.ones((1, 1, 1, 1), dtype=np.float32)


def heads_per_item(num_kv_heads: int, num_seqs: int, threads: int) -> int:
    """KV heads per work item: a sequence's all on one thread, split into runs only when there are too few
    sequences to give every thread two items (a long single-sequence context)."""
    runs = min(num_kv_heads, max(1, -(-2 * threads // num_seqs))) if threads > 1 else 1
    return -(-num_kv_heads // runs)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype == torch.float32 and \
        (k_cache.dtype == torch.float32 or is_int_kv(k_cache.dtype))


def _scales(cache: torch.Tensor, scale) -> np.ndarray:
    return scale.numpy() if is_int_kv(cache.dtype) else _NO_SCALES


@dataclass(slots=True)
class StepLayout:
    """One step's batch layout as this kernel reads it, made once per step for every layer that shares it (a
    layer's own conversions would repeat per layer): the host arrays of the decode rows, and the slot mapping the
    KV write can take without checking it again."""
    starts: np.ndarray  # query_start_loc
    seq_lens: np.ndarray  # every sequence's
    decode: np.ndarray  # the sequences with a one-token query
    decode_lens: np.ndarray  # their seq lens, int64
    decode_rows: np.ndarray  # their query rows, int64
    decode_tables: np.ndarray  # their block tables
    slots: torch.Tensor | None  # int64 slot mapping without padding slots (-1); None: the KV write checks
    decode_tokens: int = 0  # the decodes' context tokens, all of them (the work, without a window)
    longest: int = 0  # the longest decode's
    addresses: tuple[int, int, int] | None = None  # the native kernel's: decode_tables, decode_lens, decode_rows

    def native_addresses(self) -> tuple[int, int, int]:
        """The addresses of decode_tables, decode_lens and decode_rows, taken once per step for all its layers (each
        `.ctypes` costs microseconds)."""
        if self.addresses is None:
            self.addresses = (self.decode_tables.ctypes.data, self.decode_lens.ctypes.data,
                              self.decode_rows.ctypes.data)
        return self.addresses


def step_layout(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                slot_mapping: torch.Tensor | None = None) -> StepLayout:
    starts, lens = query_start_loc.numpy(), seq_lens.numpy()
    decode = np.flatnonzero(np.diff(starts) == 1)
    slots = slot_mapping if slot_mapping is None or slot_mapping.dtype == torch.int64 else slot_mapping.long()
    decode_lens = lens[decode].astype(np.int64)
    return StepLayout(starts, lens, decode, decode_lens, starts[decode].astype(np.int64), block_tables.numpy()[decode],
                      slots if slots is not None and bool((slots >= 0).all()) else None,
                      int(decode_lens.sum()), int(decode_lens.max()) if decode.size else 0)


def host_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """The caches as numpy arrays over the same memory, for a layer to keep while it keeps the caches (a conversion
    per call would repeat per layer and step); None for caches this kernel does not read."""
    if k_cache.device.type != "cpu" or not (k_cache.dtype == torch.float32 or is_int_kv(k_cache.dtype)):
        return None
    return k_cache.numpy(), v_cache.numpy()


def decode_plan(layout: StepLayout, heads: int, head_dim: int, sliding_window: int | None) -> tuple[int, int]:
    """(window, threads) of a step's decodes: the tokens a sequence reads back at most (the longest context, or the
    sliding window), and the threads their work is worth (one under PARALLEL_MIN_WORK multiply-adds)."""
    window, tokens = layout.longest, layout.decode_tokens
    if sliding_window is not None and sliding_window < window:
        window, tokens = int(sliding_window), int(np.minimum(layout.decode_lens, sliding_window).sum())
    return window, pool_threads() if tokens * heads * head_dim * 2 >= PARALLEL_MIN_WORK else 1


def _fusable(new_kv: tuple[torch.Tensor, torch.Tensor], query: torch.Tensor, layout: StepLayout) -> bool:
    """Whether the native kernel writes these new keys and values itself: a step of decodes only, each row [kv heads,
    head dim] contiguous and keys and values laid out alike (the QKV projection's output split by heads)."""
    k, v = new_kv
    return (layout.decode.size == query.shape[0] and k.dtype == v.dtype == torch.float32 and k.stride() == v.stride()
            and k.stride(2) == 1 and k.stride(1) == k.shape[2])


def _run_native(native, query, k_cache, v_cache, layout, scale, window, soft_cap, sinks, threads, out_array,
                new_kv) -> None:
    sink_values = None if sinks is None else sinks.detach().float().contiguous()
    k_new, v_new, new_stride = (None, None, 0) if new_kv is None else (new_kv[0].data_ptr(), new_kv[1].data_ptr(),
                                                                       new_kv[0].stride(0))
    tables, lens, rows = layout.native_addresses()
    native(query.data_ptr(), query.shape[1] * query.shape[2], k_cache.data_ptr(), v_cache.data_ptr(), query.shape[1],
           k_cache.shape[2], query.shape[2], k_cache.shape[1], *k_cache.stride()[:3], tables,
           layout.decode_tables.shape[1], lens, rows,
           layout.decode.size, float(scale), window, float(soft_cap or 0.0),
           None if sink_values is None else sink_values.data_ptr(),
           heads_per_item(k_cache.shape[2], layout.decode.size, threads), out_array.ctypes.data, k_new, v_new,
           new_stride, None if new_kv is None else layout.slots.data_ptr(), threads)


def _run_numba(query, k_cache, v_cache, k_scale, v_scale, layout, scale, window, soft_cap, sinks, threads, out_array,
               caches) -> None:
    kernel = _decode_kernel if threads > 1 else _decode_serial
    k_array, v_array = caches or (k_cache.numpy(), v_cache.numpy())
    kernel(query.numpy(), k_array, v_array, _scales(k_cache, k_scale), _scales(v_cache, v_scale),
           layout.decode_tables, layout.decode_lens, layout.decode_rows, np.float32(scale), window,
           np.float32(soft_cap or 0.0), _NO_SINKS if sinks is None else sinks.detach().float().numpy(),
           heads_per_item(k_cache.shape[2], layout.decode.size, threads), out_array)


def paged_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float, sliding_window: int | None = None, k_scale=None, v_scale=None, *,
                        soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                        key_limits: torch.Tensor | None = None, layout: StepLayout | None = None,
                        caches: tuple[np.ndarray, np.ndarray] | None = None,
                        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`layout`: `step_layout` of these block tables, seq lens and query starts, made once for the step's layers;
    `caches`: `host_caches` of these caches, made once by the layer that keeps them; `new_kv`: the step's keys and
    values, written into the caches at `layout.slots` (which must be set) before anything reads them: by the native
    kernel as it goes in a step of decodes only, else by `write_kv_cache_torch` first."""
    if new_kv is not None and (layout is None or layout.slots is None):
        raise ValueError("new_kv needs a step layout with its slots (no padding slot)")
    supported = supports(query, k_cache)
    if supported:
        check_variants(query.shape[1], sliding_window, soft_cap, sinks)
        if layout is None:
            layout = step_layout(block_tables, seq_lens, query_start_loc)
    native = _native_decode(k_cache, v_cache, layout.decode_tables) if supported and layout.decode.size else None
    if new_kv is not None and (native is None or not _fusable(new_kv, query, layout)):
        write_kv_cache_torch(*new_kv, k_cache, v_cache, layout.slots, k_scale, v_scale, checked=True)
        new_kv = None
    if not supported:
        return paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     sliding_window, k_scale, v_scale, soft_cap=soft_cap, sinks=sinks,
                                     key_limits=key_limits)
    out_array = np.empty(query.shape, dtype=np.float32)  # the kernel's and the caller's, no conversion
    out = torch.from_numpy(out_array)
    decode = layout.decode
    if decode.size:
        window, threads = decode_plan(layout, query.shape[1], query.shape[2], sliding_window)
        if native is not None:
            _run_native(native, query.contiguous(), k_cache, v_cache, layout, scale, window, soft_cap, sinks, threads,
                        out_array, new_kv)
        else:
            _run_numba(query.contiguous(), k_cache, v_cache, k_scale, v_scale, layout, scale, window, soft_cap, sinks,
                       threads, out_array, caches)
    if decode.size < len(layout.starts) - 1:
        prefill_attention_torch(query, k_cache, v_cache, block_tables, layout.seq_lens.tolist(),
                                layout.starts.tolist(), scale, sliding_window, k_scale, v_scale, out, soft_cap, sinks,
                                key_limits)
    return out


# The layers find what they make once for this kernel here (engine/layers/attention.py), and that it takes the step's
# new keys and values (`new_kv`) to write itself; another backend has none of these.
paged_attention_cpu.step_layout, paged_attention_cpu.host_caches = step_layout, host_caches
paged_attention_cpu.takes_new_kv = True


def warm_up(k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None, k_scale=None,
            v_scale=None) -> None:
    """Compile (or load from numba's cache) both builds now, so the first real step does not pay for it: for tiny
    contiguous caches, or with a layer's caches for exactly the arrays its steps pass (a view of the block pool,
    an integer cache with its scales), over no decode rows."""
    if k_cache is None:
        k_cache = v_cache = torch.zeros(1, 1, 1, 4)
    caches = host_caches(k_cache, v_cache)
    if caches is None:
        return
    query = np.zeros((0, 1, k_cache.shape[-1]), np.float32)
    for kernel in (_decode_kernel, _decode_serial):
        kernel(query, *caches, _scales(k_cache, k_scale), _scales(v_cache, v_scale), np.zeros((0, 1), np.int32),
               np.zeros(0, np.int64), np.zeros(0, np.int64), np.float32(1.0), np.iinfo(np.int64).max,
               np.float32(0.0), _NO_SINKS, 1, query)


paged_attention_cpu.warm_up = warm_up  # the layers compile for their caches at start (engine/layers/attention.py)
