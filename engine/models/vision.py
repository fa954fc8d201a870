"""What the vision towers share: bidirectional attention over one image's patches, patch-grid coordinates, the
bilinear resampling of a learned position grid, and the hook every vision-language family implements.

A family that takes images (Qwen3.5, Qwen3-VL, Gemma 3, Mistral3, Gemma 4) has `encode_image(data) -> [num_embeds,
hidden]` — the processor's tensors of one image (engine/multimodal/inputs.MultiModalItem.data) to the embeddings
that replace its placeholders, already in the text model's width and dtype (Qwen3-VL: DeepStack's sets after them,
[num_embeds, (1 + k) * hidden]) — and a forward that takes those embeddings at given token rows (`mm_embeds`).
Towers are replicated on every tensor-parallel rank: a few hundred million parameters next to billions, and each rank
then has the embeddings without a collective; sharding them would add two all-reduces per tower layer for a step that
runs once per image.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            scale: float | None = None) -> torch.Tensor:
    """Full attention among one image's tokens: q, k, v [N, H, D] -> [N, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale)
    return out.transpose(0, 1)


def grid_positions(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an h x w grid laid out block by block (merge x merge blocks, row-major
    inside each block and over the blocks), as the Qwen image processor orders them."""
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)

    def blocks(grid: torch.Tensor) -> torch.Tensor:
        return grid.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()

    return blocks(rows), blocks(cols)


def resample_grid(table: torch.Tensor, h: int, w: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """A learned [side, side, C] grid read bilinearly (corners aligned) at the patches (rows, cols) of an h x w
    image: F.interpolate's numbers, for the patches in their own order."""
    side = table.shape[0]

    def taps(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        src = index.float() * (side - 1) / max(size - 1, 1)
        low = src.floor()
        frac = src - low
        low = low.long().clamp(0, side - 1)
        return low, (low + 1).clamp(max=side - 1), frac

    r0, r1, fr = taps(rows, h)
    c0, c1, fc = taps(cols, w)
    fr, fc = fr[:, None], fc[:, None]
    return ((table[r0, c0] * (1 - fr) * (1 - fc) + table[r0, c1] * (1 - fr) * fc)
            + (table[r1, c0] * fr * (1 - fc) + table[r1, c1] * fr * fc))


class StackedLinear(nn.Linear):
    """Several of the checkpoint's projections in one replicated linear layer, each loaded into its rows: the
    packing every family shares (engine/models/weights.PACKED_QKV_GATE_UP) routes a tower's `q_proj`/`k_proj`/
    `v_proj` (shard ids q, k, v) and `gate_proj`/`up_proj` (0, 1) here, as it does the text model's."""

    def __init__(self, in_features: int, out_features: tuple[int, ...], shard_ids: tuple, bias: bool = True) -> None:
        super().__init__(in_features, sum(out_features), bias=bias)
        self.shard_ids = shard_ids
        starts = [sum(out_features[:i]) for i in range(len(out_features))]
        self.rows = {shard: (start, size) for shard, start, size in zip(shard_ids, starts, out_features)}
        for param in self.parameters(recurse=False):
            param.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        start, size = self.rows[shard_id]
        if loaded.shape[0] != size:
            raise ValueError(f"vision tower: checkpoint shard {shard_id!r} has {loaded.shape[0]} rows, expected {size}")
        param.data[start:start + size].copy_(loaded)
