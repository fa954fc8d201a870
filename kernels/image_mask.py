"""Key limits for a batch's image tokens (Gemma's bidirectional attention within an image), and the dense mask
HF builds for them, for tests and the benchmark. Imports nothing of ours outside kernels/.

`key_limits[t]` is the position new token t may see keys up to, exclusive: its own position + 1, or for a token
inside an image the image's end, so it also sees the image's later tokens (HF: causal OR same image; on sliding
layers AND the window's lower bound, which stays the token's own).
"""
from __future__ import annotations

import torch


def key_limits_for(query_lens: list[int], seq_lens: list[int], images: list[list[tuple[int, int]]]) -> torch.Tensor:
    """[num_tokens] int32 limits of a flat batch: per sequence, its images as (start, end) positions."""
    limits = []
    for q_len, seq_len, spans in zip(query_lens, seq_lens, images):
        positions = torch.arange(seq_len - q_len, seq_len)
        limit = positions + 1
        for start, end in spans:
            inside = (positions >= start) & (positions < end)
            limit = torch.where(inside, torch.tensor(end), limit)
        limits.append(limit)
    return torch.cat(limits).to(torch.int32)


def dense_image_mask(q_len: int, seq_len: int, spans: list[tuple[int, int]],
                     sliding_window: int | None) -> torch.Tensor:
    """[q_len, seq_len] HF's mask: (causal OR same image) AND (key > query - window)."""
    q = torch.arange(seq_len - q_len, seq_len)[:, None]
    k = torch.arange(seq_len)[None, :]
    same = torch.zeros(q_len, seq_len, dtype=torch.bool)
    for start, end in spans:
        same |= (q >= start) & (q < end) & (k >= start) & (k < end)
    mask = (k <= q) | same
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask
