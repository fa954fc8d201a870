"""Qwen's multimodal RoPE positions: three streams (temporal, height, width) per prompt token, as HF's
`get_rope_index` computes them for Qwen3.5 / Qwen3-VL.

Text tokens carry one position in all three streams, counting on from the last. An image's placeholders carry
the same temporal position and their row and column in the merged patch grid, all offset by where the image
starts; text after the image continues from the image's start plus the longer side of its grid. Every token
after the prompt (decodes, drafts) sits at its index plus `delta`, the prompt's last position + 1 minus its
length, in all three streams.
"""
from __future__ import annotations

import numpy as np

from engine.multimodal.inputs import MultiModalItem


def mrope_positions(num_tokens: int, items: list[MultiModalItem], grids: list[tuple[int, int, int]],
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """([3, num_tokens] int64 positions, delta) of a prompt whose images are `items` with grids (t, h, w) in
    patches, in prompt order."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    pos, cursor = 0, 0
    for item, (t, h, w) in zip(items, grids):
        text = item.offset - cursor
        out[:, cursor:item.offset] = np.arange(pos, pos + text)
        pos += text
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        tt, hh, ww = np.meshgrid(np.zeros(t, dtype=np.int64), np.arange(gh), np.arange(gw), indexing="ij")
        grid = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos
        assert grid.shape[1] == item.length, f"image grid {t}x{gh}x{gw} vs {item.length} placeholders"
        out[:, item.offset:item.end] = grid
        pos += max(gh, gw)
        cursor = item.end
    out[:, cursor:] = np.arange(pos, pos + num_tokens - cursor)
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return out, delta


def positions_for(prompt_positions: np.ndarray, delta: int, start: int, stop: int) -> np.ndarray:
    """[3, stop - start] positions of token indices [start, stop): the prompt's own, then index + delta."""
    prompt_len = prompt_positions.shape[1]
    out = np.empty((3, stop - start), dtype=np.int64)
    inside = max(0, min(stop, prompt_len) - start)
    out[:, :inside] = prompt_positions[:, start:start + inside]
    out[:, inside:] = np.arange(start + inside, stop) + delta
    return out
