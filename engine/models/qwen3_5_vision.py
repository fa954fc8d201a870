"""The Qwen3.5 / Qwen3.6 vision tower (`model.visual.*`): patches of one image -> its embeddings in the text model's
width, one per merged 2 x 2 patch block.

Its parts, as the checkpoint has them: a Conv3d patch embedding over (temporal_patch_size, patch, patch) cubes; a
learned square grid of position embeddings, resampled bilinearly (corners aligned) to the image's patch grid;
`depth` pre-norm blocks (LayerNorm, bidirectional attention over the image's patches with a 2-D rotary embedding —
a quarter of each head rotates by the patch row, a quarter by its column, the pattern repeated over the head —
then a GELU-tanh MLP); and a merger that concatenates each spatial_merge_size² block of patches, normalises,
and projects through a GELU MLP to `out_hidden_size`. Patches arrive in merge-block order (the image processor
lays them out so), which is also the order of the merged embeddings. Qwen3-VL's tower is this one plus DeepStack:
after each block named in `deepstack_visual_indexes` a merger of its own (normalising after the 2 x 2 concatenation)
turns that block's output into one more set of embeddings, which the text model adds to its first layers' hidden
states at the image's positions (engine/models/qwen3_vl.py); the tower returns them beside its main embeddings,
concatenated along the width, so an image stays one tensor of rows through the encoder cache. Replicated on every
tensor-parallel rank: the tower is small next to the text model, and replicating it costs no collective
(engine/models/vision.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.vision import bidirectional_attention, grid_positions, resample_grid


class PatchEmbed(nn.Module):
    def __init__(self, channels: int, temporal: int, patch: int, hidden: int) -> None:
        super().__init__()
        self.shape = (-1, channels, temporal, patch, patch)
        self.proj = nn.Conv3d(channels, hidden, kernel_size=self.shape[2:], stride=self.shape[2:], bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.view(self.shape).to(self.proj.weight.dtype)).flatten(1)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=True)
        self.proj = nn.Linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(len(x), 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(bidirectional_attention(q, k, v).reshape(len(x), -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, hidden: int, num_heads: int, intermediate: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6)
        self.attn = VisionAttention(hidden, num_heads)
        self.mlp = VisionMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int, out_hidden: int, postshuffle_norm: bool = False) -> None:
        """`postshuffle_norm` (DeepStack's mergers): the LayerNorm runs over each merged block, not each patch."""
        super().__init__()
        self.merged, self.postshuffle_norm = hidden * merge * merge, postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else hidden, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.postshuffle_norm else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3_5VisionTower(nn.Module):
    def __init__(self, tower: dict) -> None:
        super().__init__()
        hidden, heads = int(tower.get("hidden_size", 1152)), int(tower.get("num_heads", 16))
        self.merge = int(tower.get("spatial_merge_size", 2))
        self.patch_embed = PatchEmbed(int(tower.get("in_channels", 3)), int(tower.get("temporal_patch_size", 2)),
                                      int(tower.get("patch_size", 16)), hidden)
        num_positions = int(tower.get("num_position_embeddings", 2304))
        self.pos_embed = nn.Embedding(num_positions, hidden)
        self.grid_side = int(num_positions ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(hidden, heads, int(tower.get("intermediate_size", 4304)))
                                    for _ in range(int(tower.get("depth", 27))))
        self.merger = PatchMerger(hidden, self.merge, int(tower.get("out_hidden_size", 3584)))
        self.deepstack_visual_indexes = [int(i) for i in tower.get("deepstack_visual_indexes") or ()]
        if self.deepstack_visual_indexes:  # Qwen3-VL; Qwen3.5's tower has none
            self.deepstack_merger_list = nn.ModuleList(
                PatchMerger(hidden, self.merge, int(tower.get("out_hidden_size", 3584)), postshuffle_norm=True)
                for _ in self.deepstack_visual_indexes)
        head_dim = hidden // heads
        theta = float((tower.get("rope_parameters") or {}).get("rope_theta", 10_000.0))
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / theta ** quarter, persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t * h * w, C * T * P * P] -> its embeddings [t * h * w / merge², out_hidden], with
        DeepStack's after them along the width ([.., (1 + len(deepstack_visual_indexes)) * out_hidden])."""
        t, h, w = grid_thw
        rows, cols = grid_positions(h, w, self.merge)
        rows, cols = rows.repeat(t).to(self.inv_freq.device), cols.repeat(t).to(self.inv_freq.device)
        x = self.patch_embed(pixel_values)
        table = self.pos_embed.weight.view(self.grid_side, self.grid_side, -1)
        x = x + resample_grid(table, h, w, rows, cols).to(x.dtype)
        angles = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if index in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(index)](x))
        return torch.cat([self.merger(x)] + deepstack, dim=-1) if deepstack else self.merger(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head, in float32 (HF's order), back to x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)
