"""The Gemma 4 vision tower (`vision_tower.*`) and its embedder (`embed_vision.*`): one image's patches -> its
soft tokens in the text model's width.

As the checkpoint has it: the image processor resizes an image (aspect kept) to whole pooling cells and hands
over flattened patches with their (x, y) positions, padded to a fixed count (positions -1). The tower drops the
padding first — HF masks it out of attention and pooling, so the real patches' numbers are the same — then:
patches scaled to [-1, 1] and projected (no bias), plus a learned x and a learned y embedding; `num_hidden_layers`
sandwich-norm layers (Gemma 4's RMSNorm before and after attention and the MLP) whose attention has q/k norms,
a weightless norm on V, scale 1, grouped KV heads and a 2-D RoPE (the first half of each head rotated by x, the
second by y, `rope_theta` from rope_parameters) over all of the image's patches both ways; a gated MLP. Every
linear layer may clamp its input and output (`use_clipped_linears`; the bounds are checkpoint tensors). The
pooler averages each k x k cell of patches (k = pooling_kernel_size) in float32, scales by sqrt(hidden) and, with
`standardize`, subtracts `std_bias` and multiplies by `std_scale`; the embedder normalises (no weight) and
projects to the text width. Replicated on every tensor-parallel rank (engine/models/vision.py says why).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.norm import Gemma4RMSNorm
from engine.models.vision import StackedLinear, bidirectional_attention

CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


class ClippableLinear(nn.Module):
    """One or several of the checkpoint's bias-free projections stacked (`linear`, a StackedLinear), each with its
    own input/output clamp when the checkpoint clips: the bounds are [shards] parameters loaded shard by shard."""

    def __init__(self, in_features: int, out_features: tuple[int, ...], shard_ids: tuple, clipped: bool) -> None:
        super().__init__()
        self.linear = StackedLinear(in_features, out_features, shard_ids, bias=False)
        self.shard_ids, self.sizes, self.clipped = shard_ids, out_features, clipped
        if clipped:
            for bound in CLIP_BOUNDS:
                value = float("-inf") if bound.endswith("min") else float("inf")
                param = nn.Parameter(torch.full((len(shard_ids),), value), requires_grad=False)
                param.weight_loader = self.load_bound
                self.register_parameter(bound, param)

    def load_bound(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        param.data[self.shard_ids.index(shard_id)] = loaded.reshape(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        outs, start = [], 0
        for i, size in enumerate(self.sizes):
            y = F.linear(x.clamp(self.input_min[i], self.input_max[i]), self.linear.weight[start:start + size])
            outs.append(y.clamp(self.output_min[i], self.output_max[i]))
            start += size
        return torch.cat(outs, dim=-1)


def axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos/sin [N, D]: each half of D rotated (rotate-half) by its own axis' angles."""
    def rotate(part, c, s):
        a, b = part.chunk(2, dim=-1)
        return part * c + torch.cat((-b, a), dim=-1) * s
    halves, cs, ss = x.chunk(2, dim=-1), cos[:, None].chunk(2, dim=-1), sin[:, None].chunk(2, dim=-1)
    return torch.cat([rotate(p, c, s) for p, c, s in zip(halves, cs, ss)], dim=-1)


class Gemma4VisionAttention(nn.Module):
    def __init__(self, tower: dict, eps: float, clipped: bool) -> None:
        super().__init__()
        hidden = int(tower.get("hidden_size", 768))
        self.num_heads = int(tower.get("num_attention_heads", 12))
        self.num_kv_heads = int(tower.get("num_key_value_heads", self.num_heads))
        self.head_dim = d = int(tower.get("head_dim") or hidden // self.num_heads)
        self.qkv_proj = ClippableLinear(hidden, (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d),
                                        ("q", "k", "v"), clipped)
        self.o_proj = ClippableLinear(self.num_heads * d, (hidden,), (None,), clipped)
        self.q_norm, self.k_norm = Gemma4RMSNorm(d, eps), Gemma4RMSNorm(d, eps)
        self.v_norm = Gemma4RMSNorm(d, eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d = len(x), self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = axial_rope(self.q_norm(q.view(n, -1, d)), cos, sin)
        k = axial_rope(self.k_norm(k.view(n, -1, d)), cos, sin)
        v = self.v_norm(v.view(n, -1, d))
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return self.o_proj(bidirectional_attention(q, k, v, scale=1.0).reshape(n, -1))


class Gemma4VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, clipped: bool) -> None:
        super().__init__()
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"Gemma 4 vision tower: hidden_activation {act!r} is not supported")
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        self.gate_up_proj = ClippableLinear(hidden, (intermediate, intermediate), (0, 1), clipped)
        self.down_proj = ClippableLinear(intermediate, (hidden,), (None,), clipped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma4VisionEncoderLayer(nn.Module):
    def __init__(self, tower: dict, eps: float, clipped: bool) -> None:
        super().__init__()
        hidden = int(tower.get("hidden_size", 768))
        self.self_attn = Gemma4VisionAttention(tower, eps, clipped)
        self.mlp = Gemma4VisionMLP(hidden, int(tower.get("intermediate_size", 3072)),
                                   tower.get("hidden_activation", "gelu_pytorch_tanh"), clipped)
        self.input_layernorm, self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps), Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4VisionEncoder(nn.Module):
    def __init__(self, tower: dict, eps: float, clipped: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Gemma4VisionEncoderLayer(tower, eps, clipped)
                                    for _ in range(int(tower.get("num_hidden_layers", 16))))


class Gemma4PatchEmbedder(nn.Module):
    def __init__(self, hidden: int, patch: int, table_size: int) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * patch * patch, hidden, bias=False)
        self.position_embedding_table = nn.Parameter(torch.zeros(2, table_size, hidden), requires_grad=False)

    def forward(self, patches: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        x = self.input_proj((2 * (patches - 0.5)).to(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return x + (table[0][xy[:, 0]] + table[1][xy[:, 1]])


class Gemma4VisionModel(nn.Module):
    def __init__(self, tower: dict) -> None:
        super().__init__()
        hidden, eps = int(tower.get("hidden_size", 768)), float(tower.get("rms_norm_eps", 1e-6))
        rope = tower.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Gemma 4 vision tower: rope_type {rope.get('rope_type')!r} is not supported (axial)")
        clipped = bool(tower.get("use_clipped_linears"))
        self.patch_embedder = Gemma4PatchEmbedder(hidden, int(tower.get("patch_size", 16)),
                                                  int(tower.get("position_embedding_size", 10 * 1024)))
        self.encoder = Gemma4VisionEncoder(tower, eps, clipped)
        self.kernel, self.hidden = int(tower.get("pooling_kernel_size", 3)), hidden
        head_dim = int(tower.get("head_dim") or hidden // int(tower.get("num_attention_heads", 12)))
        self.rope_theta, self.spatial_dim = float(rope.get("rope_theta", 100.0)), head_dim // 2
        self.standardize = bool(tower.get("standardize"))
        if self.standardize:
            self.std_bias = nn.Parameter(torch.zeros(hidden), requires_grad=False)
            self.std_scale = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def rope(self, xy: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim]: x's angles twice, then y's twice (HF's H-H-W-W layout)."""
        # made here in float32, never a buffer a dtype cast of the model would round
        exponents = torch.arange(0, self.spatial_dim, 2, device=xy.device).float() / self.spatial_dim
        freqs = xy[..., None].float() * (1.0 / self.rope_theta ** exponents)  # [N, 2, head_dim / 4]
        layout = torch.cat([freqs[:, 0], freqs[:, 0], freqs[:, 1], freqs[:, 1]], dim=-1)
        return layout.cos().to(dtype), layout.sin().to(dtype)

    def pool(self, x: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        """Average each k x k cell of patches in float32, cells row by row, round to the tower's dtype (HF's
        order), then scale by sqrt(hidden) in float32."""
        k = self.kernel
        cells_per_row = (int(xy[:, 0].max()) + 1) // k
        cell = torch.div(xy[:, 0], k, rounding_mode="floor") + cells_per_row * torch.div(xy[:, 1], k,
                                                                                            rounding_mode="floor")
        count = len(x) // (k * k)
        weights = F.one_hot(cell.long(), count).float() / (k * k)
        return (weights.T @ x.float()).to(x.dtype).float() * self.hidden ** 0.5

    def forward(self, patches: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        """Real patches [N, 3 * patch²] at positions [N, 2] (x, y) -> [N / k², hidden] soft tokens."""
        x = self.patch_embedder(patches, xy)
        cos, sin = self.rope(xy, x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        pooled = self.pool(x, xy)
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(x.dtype)


class Gemma4VisionEmbedder(nn.Module):
    """`embed_vision`: a weightless RMSNorm, then the projection to the text width (no bias)."""

    def __init__(self, tower: dict, text_hidden: int) -> None:
        super().__init__()
        hidden = int(tower.get("output_proj_dims") or tower.get("hidden_size", 768))
        self.embedding_pre_projection_norm = Gemma4RMSNorm(hidden, float(tower.get("rms_norm_eps", 1e-6)),
                                                           with_scale=False)
        self.embedding_projection = nn.Linear(hidden, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


def encode_image(tower: Gemma4VisionModel, embedder: Gemma4VisionEmbedder, data: dict) -> torch.Tensor:
    """The processor's tensors of one image (pixel_values [1, max_patches, 3 * patch²], image_position_ids
    [1, max_patches, 2], -1 for padding) -> [soft tokens, text hidden]."""
    device = embedder.embedding_projection.weight.device
    pixels, xy = data["pixel_values"][0], data["image_position_ids"][0]
    real = (xy != -1).all(dim=-1)
    return embedder(tower(pixels[real].to(device), xy[real].to(device).long()))
