"""Plain-torch paged attention: the CPU path and the oracle every Triton kernel is tested against.

Layout shared by every backend:
- K/V cache of one layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``, in the compute dtype or
  an 8-bit float type (then values are stored divided by a per-tensor scale), or an integer format
  (kernels/kv_int_torch.py: int8 or packed int4, then `k_scale`/`v_scale` are the per-token-head-group scale
  tensors ``[num_blocks, block_size, num_kv_heads, head_dim / group]`` the write fills and every read uses).
- ``slot_mapping[t] = block_id * block_size + offset`` for each new token; a negative slot is skipped.
- A flat batch of ``num_seqs`` sequences: ``query_start_loc`` (``[num_seqs + 1]``, cumulative counts of
  new tokens), ``seq_lens`` (context + new tokens of each sequence) and ``block_tables``
  (``[num_seqs, max_blocks]``, unused entries are ignored). New tokens of a sequence sit at the last
  positions ``seq_len - query_len .. seq_len - 1`` and attend causally; their K/V are written before
  attention runs, so attention reads only the cache.
Variants every backend takes: ``sliding_window`` W (a query sees its last W positions, itself included, as
HF's sliding-window mask), ``soft_cap`` c (Gemma 2: scores become ``c * tanh(scores / c)`` before masking)
``sinks`` (gpt-oss: one learned logit per query head that joins the softmax denominator and carries no
value) and ``key_limits`` (``[num_tokens]`` int32: the position each new token may see keys up to, exclusive,
when that is past its own; Gemma's image tokens see their whole image: causal OR same image, within the window
as HF composes them). The scale is the caller's (``head_dim ** -0.5``, or ``query_pre_attn_scalar ** -0.5`` for Gemma).
Without soft-capping or sinks both paths use SDPA; with either, scores are formed explicitly in fp32.
Imports nothing of ours.
"""
from __future__ import annotations

import torch

from kernels.kv_int_torch import dequantize_int, group_size, is_int_kv, quantize_int

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DECODE_GROUP = 8  # decodes per padded attention call


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale saturated to the finite range of `dtype`, then cast (the cast alone would make inf/nan)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(cache: torch.Tensor, scale: torch.Tensor | float | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows in `dtype`; an integer cache's `scale` is the rows' own scales (read alongside, `read_kv`)."""
    if is_int_kv(cache.dtype):
        return dequantize_int(cache, scale, dtype)
    if not is_fp8(cache.dtype):
        return cache.to(dtype)
    return (cache.float() * (1.0 if scale is None else scale)).to(dtype)


def read_kv(cache: torch.Tensor, scale, take, dtype: torch.dtype) -> torch.Tensor:
    """`take` (an indexing of a cache-shaped tensor) applied to the cache, dequantized in `dtype`: an integer cache's
    scale tensor is taken the same way, a per-tensor FP8 scale is used as is."""
    return dequantize(take(cache), take(scale) if is_int_kv(cache.dtype) else scale, dtype)


def write_kv_cache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: torch.Tensor | float | None = None,
                         v_scale: torch.Tensor | float | None = None, *, checked: bool = False) -> None:
    """Store key/value ``[num_tokens, num_kv_heads, head_dim]`` at their slots of the paged cache. `checked`: the
    slot mapping is int64 with no padding slot (-1), as the caller made sure once for every layer of its step."""
    if not checked:
        slot_mapping = slot_mapping.long()  # index_copy_ takes int64 indices only
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_blocks, block_size, heads, dim = k_cache.shape
    for src, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        flat = cache.view(num_blocks * block_size, heads, dim)
        if is_int_kv(cache.dtype):  # the values and their scales, at the same slots
            values, scales = quantize_int(src, cache.dtype, group_size(cache, scale))
            flat.index_copy_(0, slot_mapping, values)
            scale.view(num_blocks * block_size, heads, -1).index_copy_(0, slot_mapping, scales)
        elif is_fp8(cache.dtype):
            # index_copy_ has no fp8 kernel on CPU; copy the bytes through a uint8 view instead.
            data = quantize_fp8(src, 1.0 if scale is None else scale, cache.dtype)
            flat.view(torch.uint8).index_copy_(0, slot_mapping, data.view(torch.uint8))
        else:
            flat.index_copy_(0, slot_mapping, src if src.dtype == cache.dtype else src.to(cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first_block: int = 0) -> torch.Tensor:
    """Cached tokens ``first_block * block_size .. seq_len - 1`` of one sequence as ``[tokens, kv_heads, dim]``."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[first_block:num_blocks].long()].flatten(0, 1)[:seq_len - first_block * block_size]


def paged_attention_torch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          scale: float, sliding_window: int | None = None,
                          k_scale: torch.Tensor | float | None = None, v_scale: torch.Tensor | float | None = None,
                          *, soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                          key_limits: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cache; returns ``[num_tokens, heads, dim]``.

    Sequences with one new token (decodes) are batched into one padded call; longer query runs (prefill
    chunks) go one sequence at a time. `sinks`: ``[num_heads]`` logits, any float dtype. `key_limits` extend
    only prefill chunks' tokens (a decode token is never an image's).
    """
    check_variants(query.shape[1], sliding_window, soft_cap, sinks)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if decode:
        _decode_batch(query, k_cache, v_cache, block_tables, lens, starts, decode, scale, sliding_window,
                      k_scale, v_scale, out, soft_cap, sinks)
    prefill_attention_torch(query, k_cache, v_cache, block_tables, lens, starts, scale, sliding_window, k_scale,
                            v_scale, out, soft_cap, sinks, key_limits)
    return out


def check_variants(num_heads: int, sliding_window: int | None, soft_cap: float | None,
                   sinks: torch.Tensor | None) -> None:
    """The variant arguments every backend accepts, checked once with the numbers in the message."""
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window {sliding_window}: must be positive, or None for full attention")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap {soft_cap}: must be positive, or None for no soft-capping")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}: need one logit per query head, ({num_heads},)")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
           soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scores) V with q ``[..., H, Lq, D]``, k/v ``[..., Hkv, Lk, D]`` (GQA when Hkv < H) and a
    boolean `visible` mask broadcastable to ``[..., H, Lq, Lk]``; every query must see at least one key.

    The plain case is one SDPA call (its fused CPU kernel is about twice as fast as the explicit form);
    soft-capping and sinks have no SDPA form, so they take the explicit fp32 path, like HF's eager attention.
    """
    group = q.shape[-3] // k.shape[-3]
    if soft_cap is None and sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale,
                                                                enable_gqa=group > 1)
    k, v = k.float().repeat_interleave(group, dim=-3), v.float().repeat_interleave(group, dim=-3)
    scores = q.float() @ k.transpose(-1, -2) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more logit per head, dropped after the softmax: it only adds to the denominator
        sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return (probs @ v).to(q.dtype)


def prefill_attention_torch(query, k_cache, v_cache, block_tables, lens: list[int], starts: list[int], scale: float,
                            sliding_window, k_scale, v_scale, out: torch.Tensor, soft_cap: float | None = None,
                            sinks: torch.Tensor | None = None, key_limits: torch.Tensor | None = None) -> None:
    """Into `out`: every sequence with more than one new token (a prefill chunk), one attention call each over
    its gathered context (the gather is paid once per chunk, not once per generated token). With a window,
    only the blocks from the one holding the first query's oldest visible key are read: blocks wholly behind
    the window may have been freed (their table entries then point at a filler block)."""
    block_size = k_cache.shape[1]
    for i, seq_len in enumerate(lens):
        start, q_len = starts[i], starts[i + 1] - starts[i]
        if q_len <= 1:
            continue
        first_block = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1) // block_size

        def take(t: torch.Tensor) -> torch.Tensor:
            return gather_kv(t, block_tables[i], seq_len, first_block)
        k, v = read_kv(k_cache, k_scale, take, query.dtype), read_kv(v_cache, v_scale, take, query.dtype)
        q = query[start:start + q_len]
        limits = None if key_limits is None else key_limits[start:start + q_len]
        mask = _causal_mask(q_len, seq_len, sliding_window, first_block * block_size, query.device, limits)
        o = attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale, soft_cap, sinks)
        out[start:start + q_len] = o.transpose(0, 1)


def _causal_mask(q_len: int, seq_len: int, sliding_window: int | None, first_key: int,
                 device: torch.device, key_limits: torch.Tensor | None = None) -> torch.Tensor:
    """[q_len, seq_len - first_key]: which keys (positions first_key..seq_len-1) each new token sees."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(first_key, seq_len, device=device)[None, :]
    last = q_pos if key_limits is None else torch.maximum(q_pos, key_limits.to(device).long()[:, None] - 1)
    mask = k_pos <= last
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _decode_batch(query, k_cache, v_cache, block_tables, lens, starts, decode, scale, sliding_window,
                  k_scale, v_scale, out, soft_cap, sinks) -> None:
    """All one-token queries, sorted by length and cut into groups, each one padded attention call.

    Sorting keeps padding small (each group pads only to its own longest context)."""
    order = sorted(decode, key=lambda i: lens[i])
    for g in range(0, len(order), DECODE_GROUP):
        _decode_group(query, k_cache, v_cache, block_tables, lens, starts, order[g:g + DECODE_GROUP], scale,
                      sliding_window, k_scale, v_scale, out, soft_cap, sinks)


def _decode_group(query, k_cache, v_cache, block_tables, lens, starts, rows_of, scale, sliding_window,
                  k_scale, v_scale, out, soft_cap, sinks) -> None:
    """Gather each sequence's visible tokens (all of them, or the last `sliding_window`) padded to the group's
    longest run; a padding position re-reads the sequence's own last token (finite, and masked out of the
    softmax), so no stale slot, unused or freed block-table entry is ever read and nothing needs zeroing."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    device = query.device
    seq_lens = torch.tensor([lens[i] for i in rows_of], device=device)
    first = torch.zeros_like(seq_lens) if sliding_window is None else (seq_lens - sliding_window).clamp_(min=0)
    pos = first[:, None] + torch.arange(int((seq_lens - first).max()), device=device)[None, :]
    own = torch.minimum(pos, seq_lens[:, None] - 1)
    table = block_tables[rows_of].long()
    slots = table.gather(1, own // block_size) * block_size + own % block_size  # [B, L]
    flat = slots.flatten()  # index_select on flat slots: faster on CPU than advanced indexing

    def take(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *t.shape[2:]).index_select(0, flat)
    k, v = read_kv(k_cache, k_scale, take, query.dtype), read_kv(v_cache, v_scale, take, query.dtype)
    k, v = k.view(*slots.shape, num_kv_heads, -1), v.view(*slots.shape, num_kv_heads, -1)
    valid = pos < seq_lens[:, None]
    rows = torch.tensor([starts[i] for i in rows_of], device=device)
    o = attend(query[rows][:, :, None], k.transpose(1, 2), v.transpose(1, 2), valid[:, None, None, :], scale,
               soft_cap, sinks)
    out[rows] = o[:, :, 0]
