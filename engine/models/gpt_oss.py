"""gpt-oss (GptOssForCausalLM), its attention half: the attention module and a decoder layer with an MLP slot.

Attention differs from Llama's in three ways, all handled below the family: learned per-head sinks (one more
logit per head in the softmax denominator, no value; PagedAttention owns the parameter and splits it by head
under tensor parallel), sliding-window (128) and global layers alternating from the first, and YaRN RoPE
(engine/layers/rotary.py). q/k/v and o projections carry biases. The experts are not here: the decoder layer
takes its MLP module from the caller, so the mixture-of-experts family code only plugs one in, and the
architecture is not registered until it does (a checkpoint's expert tensors would have nowhere to go).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.models.weights import checkpoint_modules


class GptOssAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: str, rotary_emb: RotaryEmbedding,
                 packed: dict) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.self_attn"
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, cfg.quantization, prefix,
                                          checkpoint_modules(packed, "qkv_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.qkv_bias,
                                        cfg.quantization, prefix, ("o_proj",))
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.sliding_windows[layer],
                                   backend, use_sinks=True)
        # Registered here too, first, so the parameter's name is the checkpoint's `self_attn.sinks`.
        self.sinks = self.attn.sinks

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q.view(-1, self.num_heads, self.head_dim),
                               k.view(-1, self.num_kv_heads, self.head_dim))
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta)
        return self.o_proj(out.reshape(-1, q_size))


class GptOssDecoderLayer(nn.Module):
    """Pre-norm residual block around GptOssAttention and `mlp` (the experts: any module [T, H] -> [T, H])."""

    def __init__(self, cfg: ModelConfig, layer: int, backend: str, rotary_emb: RotaryEmbedding, packed: dict,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer, backend, rotary_emb, packed)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
