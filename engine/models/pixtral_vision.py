"""The Mistral3 vision tower (Pixtral, `vision_tower.*`) and its projector (`multi_modal_projector.*`): one image's
pixels, at the size the image processor chose, -> one embedding per spatial_merge_size² block of patches, in the
text model's width.

Pixtral, as the checkpoint has it: a bias-free Conv2d patch embedding over the image's own patch grid, an RMSNorm
(`ln_pre`), then pre-norm layers (RMSNorm, bidirectional attention over the image's patches with Pixtral's axial
2-D rotary embedding — the even frequencies turn with the patch row, the odd ones with its column, over the whole
head — RMSNorm, a gated MLP on vision_config.hidden_act: SiLU in the published towers), no final norm (the projector reads the last layer, vision_feature_layer -1).
The projector: RMSNorm, a patch merger that concatenates each merge x merge block (F.unfold's order) into a
linear layer, then linear, GELU, linear. Replicated on every tensor-parallel rank (engine/models/vision.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.norm import RMSNorm
from engine.models.vision import StackedLinear, bidirectional_attention


class PixtralAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv_proj = StackedLinear(hidden, (hidden,) * 3, ("q", "k", "v"), bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(len(x), 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.o_proj(bidirectional_attention(q, k, v).reshape(len(x), -1))


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}  # vision_config.hidden_act: published towers say silu


class PixtralMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"Pixtral vision_config.hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = StackedLinear(hidden, (intermediate, intermediate), (0, 1), bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class PixtralLayer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(hidden, 1e-5)
        self.attention = PixtralAttention(hidden, num_heads)
        self.ffn_norm = RMSNorm(hidden, 1e-5)
        self.feed_forward = PixtralMLP(hidden, intermediate, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, tower: dict) -> None:
        super().__init__()
        hidden = int(tower.get("hidden_size", 1024))
        self.layers = nn.ModuleList(
            PixtralLayer(hidden, int(tower.get("num_attention_heads", 16)), int(tower.get("intermediate_size", 4096)),
                         str(tower.get("hidden_act", "gelu")))
            for _ in range(int(tower.get("num_hidden_layers", 24))))


class PixtralVisionModel(nn.Module):
    def __init__(self, tower: dict) -> None:
        super().__init__()
        hidden, heads = int(tower.get("hidden_size", 1024)), int(tower.get("num_attention_heads", 16))
        self.patch_size = int(tower.get("patch_size", 16))
        self.patch_conv = nn.Conv2d(int(tower.get("num_channels", 3)), hidden, kernel_size=self.patch_size,
                                    stride=self.patch_size, bias=False)
        self.ln_pre = RMSNorm(hidden, 1e-5)
        self.transformer = PixtralTransformer(tower)
        head_dim = int(tower.get("head_dim") or hidden // heads)
        rope = tower.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", tower.get("rope_theta", 10_000.0)))
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("row_freq", inv_freq[0::2].clone(), persistent=False)
        self.register_buffer("col_freq", inv_freq[1::2].clone(), persistent=False)

    def forward(self, pixels: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, int, int]:
        """[1, C, H', W'] (padded) and the image's own size -> [h * w, hidden] over its h x w patch grid."""
        h, w = height // self.patch_size, width // self.patch_size
        x = self.patch_conv(pixels.to(self.patch_conv.weight.dtype))[0, :, :h, :w].flatten(1).T
        x = self.ln_pre(x)
        rows = torch.arange(h, device=x.device).repeat_interleave(w).float()
        cols = torch.arange(w, device=x.device).repeat(h).float()
        angles = torch.cat([rows[:, None] * self.row_freq, cols[:, None] * self.col_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]
        for layer in self.transformer.layers:
            x = layer(x, cos, sin)
        return x, h, w


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(hidden * merge * merge, hidden, bias=False)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        grid = x.view(h, w, -1).permute(2, 0, 1)[None]
        blocks = F.unfold(grid, kernel_size=self.merge, stride=self.merge)[0].T
        return self.merging_layer(blocks)


class Mistral3Projector(nn.Module):
    def __init__(self, tower: dict, text_hidden: int, merge: int, eps: float, bias: bool) -> None:
        super().__init__()
        hidden = int(tower.get("hidden_size", 1024))
        self.norm = RMSNorm(hidden, eps)
        self.patch_merger = PatchMerger(hidden, merge)
        self.linear_1 = nn.Linear(hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        merged = self.patch_merger(self.norm(x), h, w)
        return self.linear_2(F.gelu(self.linear_1(merged)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head (HF's order, in x's dtype)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
