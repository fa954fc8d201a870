"""The Gemma 3 vision tower (SigLIP, `vision_tower.*`; hub files nest it under `vision_model.`) and its projector
(`model.multi_modal_projector.*`): one image's pixels -> `mm_tokens_per_image` embeddings in the text model's width.

SigLIP, as the checkpoint has it: a Conv2d patch embedding over a fixed image_size square (the image processor
resizes every image to it), a learned position embedding per patch, `num_hidden_layers` pre-norm encoder layers
(LayerNorm, bidirectional multi-head attention with biases, LayerNorm, a GELU-tanh MLP) and a final LayerNorm; no
pooling head. The projector average-pools the patch grid down to a tokens_per_side square, normalises with Gemma's
(1 + w) RMSNorm and multiplies by `mm_input_projection_weight` ([vision hidden, text hidden]). Replicated on every
tensor-parallel rank (engine/models/vision.py says why).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.norm import GemmaRMSNorm
from engine.models.vision import StackedLinear, bidirectional_attention


class SiglipEmbeddings(nn.Module):
    def __init__(self, channels: int, hidden: int, patch: int, image_size: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding((image_size // patch) ** 2, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x[0] + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv_proj = StackedLinear(hidden, (hidden,) * 3, ("q", "k", "v"))
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(len(x), 3, self.num_heads, self.head_dim).unbind(1)
        return self.out_proj(bidirectional_attention(q, k, v).reshape(len(x), -1))


class SiglipMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, hidden: int, num_heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = SiglipAttention(hidden, num_heads)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = SiglipMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, tower: dict, eps: float) -> None:
        super().__init__()
        hidden = int(tower.get("hidden_size", 1152))
        self.layers = nn.ModuleList(
            SiglipEncoderLayer(hidden, int(tower.get("num_attention_heads", 16)),
                               int(tower.get("intermediate_size", 4304)), eps)
            for _ in range(int(tower.get("num_hidden_layers", 27))))


class SiglipVisionModel(nn.Module):
    def __init__(self, tower: dict) -> None:
        super().__init__()
        if tower.get("vision_use_head"):
            raise ValueError("a SigLIP tower with a pooling head (vision_use_head) is not a Gemma 3 tower")
        hidden, eps = int(tower.get("hidden_size", 1152)), float(tower.get("layer_norm_eps", 1e-6))
        self.embeddings = SiglipEmbeddings(int(tower.get("num_channels", 3)), hidden,
                                           int(tower.get("patch_size", 14)), int(tower.get("image_size", 896)))
        self.encoder = SiglipEncoder(tower, eps)
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, C, S, S] -> [patches, hidden]."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    def __init__(self, tower: dict, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        hidden = int(tower.get("hidden_size", 1152))
        patches_per_side = int(tower.get("image_size", 896)) // int(tower.get("patch_size", 14))
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(hidden, text_hidden), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(hidden, float(tower.get("layer_norm_eps", 1e-6)))
        self.patches_per_side = patches_per_side
        self.kernel = patches_per_side // int(tokens_per_image ** 0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[patches, vision hidden] -> [tokens_per_image, text hidden]."""
        grid = patches.T.reshape(1, -1, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)[0].T
        normed = self.mm_soft_emb_norm(pooled.contiguous())
        return (normed @ self.mm_input_projection_weight).to(patches.dtype)
