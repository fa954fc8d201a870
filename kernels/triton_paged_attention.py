"""Triton paged attention over a flat mixed batch: decodes and prefill chunks in one launch, flash style.

Grid ``(num_q_blocks, num_kv_heads, num_splits)``. A program owns up to BLOCK_Q consecutive new tokens of
one sequence and all GROUP query heads that share one KV head, i.e. a ``[BLOCK_M = BLOCK_Q * GROUP, D]``
query tile (GQA packing: K/V are read once per KV head). It finds its sequence by binary search over
``query_start_loc`` (no host sync), then walks the sequence's KV positions in TILE_N-token tiles, each
token gathered through ``block_tables`` (so TILE_N is independent of the cache block size), with causal
and sliding-window masks and an online softmax in fp32. With ``num_splits > 1`` the KV range of each
program is cut into equal pieces whose partial (max, sum, accumulator) go to scratch buffers that
``reduce_splits_kernel`` combines (flash-decoding, for batches too small to fill the GPU). FP8 caches
are read as bytes and decoded in registers (kernels/triton_fp8.py); the per-tensor k_scale is folded
into the softmax scale and v_scale is applied once to the output. Integer caches (INT_BITS 8 or 4) read each value
times its group's scale from the scale tensors (kernels/triton_kv_int.py); their per-tensor scales are 1. Variants are constexpr flags, so the
plain kernel carries none of their code: USE_WINDOW (sliding window), SOFT_CAP (``cap * tanh(s / cap)``
on the scaled scores, Gemma 2), USE_SINKS (a learned per-head logit that starts split 0's running max
and sum, so it joins the softmax denominator with no value, gpt-oss) and KEY_LIMITS (per new token, the
position its keys may reach, exclusive, past its own: Gemma's image tokens see their whole image).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_fp8 import fp8_to_float
from kernels.triton_kv_int import load_int_kv

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _q_block_start(query_start_loc_ptr, seq, BLOCK_Q: tl.constexpr):
    """First q-block id of `seq`: q blocks never straddle sequences, so each one may add a partial block."""
    if BLOCK_Q == 1:
        return tl.load(query_start_loc_ptr + seq)
    else:
        return tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The last sequence whose first q block is <= q_block (binary search; starts are non-decreasing)."""
    lo = tl.full([], 0, tl.int32)
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        starts_before = _q_block_start(query_start_loc_ptr, mid, BLOCK_Q) <= q_block
        lo = tl.where(starts_before, mid, lo)
        hi = tl.where(starts_before, hi, mid - 1)
    return lo


@triton.jit
def _kv_tiles(context_len, first_q, seq_len, sliding_window, split, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
              NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, KEY_LIMITS: tl.constexpr = False):
    """This split's KV tiles [begin, end) and the KV range [kv_begin, kv_end) the q block can see (up to its
    last query, or the sequence's end with key limits; back to the window start of its first query), the tiles
    cut into NUM_SPLITS equal pieces."""
    kv_end = tl.minimum(context_len + first_q + BLOCK_Q, seq_len)
    if KEY_LIMITS:
        kv_end = seq_len
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(context_len + first_q - sliding_window + 1, 0)
    tile_begin = kv_begin // TILE_N
    tile_end = tl.cdiv(kv_end, TILE_N)
    per_split = tl.cdiv(tile_end - tile_begin, NUM_SPLITS)
    begin = tile_begin + split * per_split
    return begin, tl.minimum(begin + per_split, tile_end), kv_begin, kv_end


@triton.jit
def _load_kv(cache_ptr, scales_ptr, rows, scale_rows, dims, mask, FP8_FORMAT: tl.constexpr,
             COMPUTE_DTYPE: tl.constexpr, INT_BITS: tl.constexpr, INT_GROUP: tl.constexpr):
    """The values at `rows + dims` (broadcast together) in the compute dtype."""
    if INT_BITS != 0:
        x = load_int_kv(cache_ptr, scales_ptr, rows, scale_rows, dims, mask, INT_BITS, INT_GROUP)
    else:
        x = tl.load(cache_ptr + rows + dims, mask=mask, other=0)
        if FP8_FORMAT != 0:
            x = fp8_to_float(x, FP8_FORMAT)
    return x.to(COMPUTE_DTYPE)


@triton.jit
def _tanh(x):
    """tanh as 2·sigmoid(2x) − 1: saturates to ±1 for any finite x (the (eˣ − e⁻ˣ)/(eˣ + e⁻ˣ) form gives
    inf/inf = nan past |x| ≈ 88), and needs no libdevice."""
    return 2.0 / (1.0 + tl.exp2(x * (-2.0 * LOG2E))) - 1.0


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


# Arguments that change from step to step are not specialised on (Triton would otherwise compile a variant
# for values equal to 1 or divisible by 16): the batch's sequence count and its block-table width.
@triton.jit(do_not_specialize=["num_seqs", "sliding_window", "stride_bt_seq"])
def paged_attention_kernel(
        out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
        query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        k_scale_ptr, v_scale_ptr, sinks_ptr, k_scales_ptr, v_scales_ptr, key_limits_ptr, softmax_scale, soft_cap,
        num_seqs, num_heads, sliding_window, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt_seq,
        stride_kc_block, stride_kc_tok, stride_kc_head, stride_vc_block, stride_vc_tok, stride_vc_head,
        stride_ks_block, stride_ks_tok, stride_ks_head, stride_vs_block, stride_vs_tok, stride_vs_head,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        USE_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, USE_SINKS: tl.constexpr, FP8_FORMAT: tl.constexpr,
        IEEE: tl.constexpr, NUM_STAGES: tl.constexpr, LARGE_POOL: tl.constexpr, INT_BITS: tl.constexpr,
        INT_GROUP: tl.constexpr, KEY_LIMITS: tl.constexpr = False):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = (q_block - _q_block_start(query_start_loc_ptr, seq, BLOCK_Q)) * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    tokens = (q_start + q_idx).to(tl.int64)
    q = tl.load(query_ptr + tokens[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    last_key = q_pos  # the last position each row sees: its own, or past it (an image's tokens, KEY_LIMITS)
    if KEY_LIMITS:
        limit = tl.load(key_limits_ptr + tokens, mask=row_valid, other=0)
        last_key = tl.maximum(q_pos, limit - 1)
    my_begin, my_end, kv_begin, kv_end = _kv_tiles(context_len, first_q, seq_len, sliding_window, split, BLOCK_Q,
                                                   TILE_N, NUM_SPLITS, USE_WINDOW, KEY_LIMITS)
    # Scores live in the exp2 domain (times log2 e); with soft-capping, tanh sees s / cap and its result is
    # scaled by cap * log2 e.
    qk_scale = softmax_scale * tl.load(k_scale_ptr)
    if SOFT_CAP:
        qk_scale = qk_scale / soft_cap
    else:
        qk_scale = qk_scale * LOG2E
    cap_scale = soft_cap * LOG2E
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:  # the sink as a logit already seen with weight exp(0) = 1; once, in split 0 only
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * LOG2E
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile in tl.range(my_begin, my_end, num_stages=NUM_STAGES):
        pos = tile * TILE_N + tl.arange(0, TILE_N)
        in_range = pos < kv_end
        if USE_WINDOW:  # never read a table entry behind the window: its block may be freed
            in_range = in_range & (pos >= kv_begin)
        block_id = tl.load(block_table + pos // BLOCK_SIZE, mask=in_range, other=0)
        if LARGE_POOL:  # int32 offsets need fewer registers; pools of 2^31+ elements need int64
            block_id = block_id.to(tl.int64)
        k_offsets = block_id * stride_kc_block + (pos % BLOCK_SIZE) * stride_kc_tok + kv_head * stride_kc_head
        ks_offsets = block_id * stride_ks_block + (pos % BLOCK_SIZE) * stride_ks_tok + kv_head * stride_ks_head
        k = _load_kv(k_cache_ptr, k_scales_ptr, k_offsets[None, :], ks_offsets[None, :], dims[:, None],
                     in_range[None, :] & dim_valid[:, None], FP8_FORMAT, query_ptr.dtype.element_ty, INT_BITS,
                     INT_GROUP)
        scores = _dot(q, k, IEEE) * qk_scale
        if SOFT_CAP:
            scores = _tanh(scores) * cap_scale
        visible = in_range[None, :] & (pos[None, :] <= last_key[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offsets = block_id * stride_vc_block + (pos % BLOCK_SIZE) * stride_vc_tok + kv_head * stride_vc_head
        vs_offsets = block_id * stride_vs_block + (pos % BLOCK_SIZE) * stride_vs_tok + kv_head * stride_vs_head
        v = _load_kv(v_cache_ptr, v_scales_ptr, v_offsets[:, None], vs_offsets[:, None], dims[None, :],
                     in_range[:, None] & dim_valid[None, :], FP8_FORMAT, query_ptr.dtype.element_ty, INT_BITS,
                     INT_GROUP)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    _store_result(out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, v_scale_ptr, m_i, l_i, acc, tokens, head,
                  split, num_heads, row_valid, dims, dim_valid, stride_o_tok, stride_o_head, BLOCK_D, NUM_SPLITS)


@triton.jit
def _store_result(out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, v_scale_ptr, m_i, l_i, acc, tokens, head,
                  split, num_heads, row_valid, dims, dim_valid, stride_o_tok, stride_o_head,
                  BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Normalised rows straight to the output, or this split's softmax state to the scratch buffers."""
    if NUM_SPLITS == 1:
        out = acc * (tl.load(v_scale_ptr) / tl.where(l_i > 0, l_i, 1.0))[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    else:
        part = (tokens * num_heads + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], acc, mask=row_valid[:, None])


@triton.jit
def reduce_splits_kernel(out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, v_scale_ptr, num_heads,
                         stride_o_tok, stride_o_head, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Combine the per-split softmax states of one (token, head) into the normalised output row."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    part = (token * num_heads + head) * NUM_SPLITS + splits
    split_valid = splits < NUM_SPLITS
    m = tl.load(part_max_ptr + part, mask=split_valid, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_valid, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(weight * l, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=split_valid[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) * (tl.load(v_scale_ptr) / tl.where(total > 0, total, 1.0))
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)
