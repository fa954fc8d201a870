"""The self-attention block of a decoder layer (`self_attn`), one implementation for every family that has one.

QKV projection and split, optional per-head q/k norms, rotary through the layer's RotaryEmbedding table (partial
rotary is the table's business; None: a layer without positions, SmolLM3's NoPE layers), PagedAttention with the
layer's sliding window, then the output projection. What differs between families is a set of switches
(`AttentionSwitches`, built once per model from its ModelConfig by the family, engine/models/*); the layer index
gives the rest (window, head width, KV heads). Parameter names are the checkpoints' (`qkv_proj` stacks
q/k/v_proj, `o_proj`, `q_norm`, `k_norm`, gpt-oss's `sinks`), so families load through the same mappings.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config.model import ModelConfig
from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.linear import QKVParallelLinear, RowParallelLinear, checkpoint_modules
from engine.layers.rotary import RotaryEmbedding


@dataclass(frozen=True, slots=True)
class AttentionSwitches:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: type[nn.Module] | None = None  # the norm over each head of q and k (RMSNorm, GemmaRMSNorm), or none
    output_gate: bool = False  # q_proj gives [query | gate] per head; out * sigmoid(gate) before o_proj (Qwen3.5)
    sinks: bool = False  # a learned sink logit per head (gpt-oss)
    scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    soft_cap: float | None = None  # attention logits soft-capped (Gemma 2)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, switches: AttentionSwitches,
                 rotary_emb: RotaryEmbedding | None, backend: str, packed: dict) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.self_attn"
        d = self.head_dim = cfg.layer_head_dim(layer)
        # A gated q_proj holds 2 * head_dim per head ([query | gate]): heads of twice the size split the same way.
        widen = 2 if switches.output_gate else 1
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, widen * cfg.num_heads, cfg.layer_kv_heads(layer),
                                          switches.qkv_bias, cfg.quantization, prefix,
                                          checkpoint_modules(packed, "qkv_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // widen, self.qkv_proj.num_kv_heads
        self.output_gate = switches.output_gate
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, switches.o_bias, cfg.quantization,
                                        prefix, ("o_proj",))
        norm = switches.qk_norm
        self.q_norm = norm(d, cfg.rms_norm_eps) if norm else None
        self.k_norm = norm(d, cfg.rms_norm_eps) if norm else None
        self.rotary_emb = rotary_emb  # shared by the layers of one kind: one cos/sin table
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, cfg.sliding_windows[layer], backend,
                                   scale=switches.scale, soft_cap=switches.soft_cap, use_sinks=switches.sinks)
        if switches.sinks:  # registered here too, so the parameter's name is the checkpoint's `self_attn.sinks`
            self.sinks = self.attn.sinks

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        q, k, v, gate = self.split_qkv(self.qkv_proj(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta, gate=gate)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def split_qkv(self, qkv: torch.Tensor):
        """[T, q | k | v] -> q [T, H, D], k and v [T, Hkv, D], and the output gate [T, H, D] or None."""
        if self.output_gate:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            qg, k, v = qkv.split([2 * q_size, kv_size, kv_size], dim=-1)
            q, gate = qg.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            kv = (-1, self.num_kv_heads, self.head_dim)
            return q.contiguous(), k.view(kv), v.view(kv), gate
        # Split by heads: one view and one split, the same strided views as splitting the features first.
        heads = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return q, k, v, None
