"""The Llama family: Llama, Qwen2, Qwen3 and Mistral, one pre-norm decoder with switches read from ModelConfig.

The switches: QKV bias (Qwen2), q/k RMSNorm (Qwen3), tied embeddings, explicit head_dim, RoPE scaling,
per-layer sliding window (Mistral). Weights stream straight from safetensors into these modules through each
parameter's weight_loader (engine/models/weights.py); no transformers model object. Quantized checkpoints load
the same way: the linear layers hold the packed tensors under their checkpoint names.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rotary_embeddings
from engine.config.model import ModelConfig
from engine.models.weights import (PACKED_QKV_GATE_UP, VL_TEXT_MAPPER, WeightsMapper, checkpoint_modules,
                                   load_weights)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: str, rotary_emb: RotaryEmbedding,
                 packed: dict) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.self_attn"
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, cfg.quantization, prefix,
                                          checkpoint_modules(packed, "qkv_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, cfg.quantization,
                                        prefix, ("o_proj",))
        self.rotary_emb = rotary_emb  # shared by the layers of one kind: one cos/sin table
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.sliding_windows[layer],
                                   backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.reshape(-1, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, packed: dict) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported by the {cfg.architecture} family "
                             "(silu only)")
        prefix = f"model.layers.{layer}.mlp"
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False,
                                                       cfg.quantization, prefix,
                                                       checkpoint_modules(packed, "gate_up_proj"))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, cfg.quantization, prefix,
                                           ("down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: str, rotary_emb: RotaryEmbedding,
                 packed: dict, mlp_factory=LlamaMLP) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, backend, rotary_emb, packed)
        self.mlp = mlp_factory(cfg, layer, packed)  # MoE families (engine/models/qwen3_moe.py) put their experts here
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


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str, packed: dict, mlp_factory=LlamaMLP) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        ropes = rotary_embeddings(cfg)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, backend, ropes[cfg.layer_types[i]], packed, mlp_factory)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = PACKED_QKV_GATE_UP
    weights_mapper = WeightsMapper()
    mlp_factory = LlamaMLP
    model_class = LlamaModel  # gpt-oss swaps the layer stack and keeps the rest

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        super().__init__()
        self.config = cfg
        self.model = type(self).model_class(cfg, backend, self.packed_modules_mapping, type(self).mlp_factory)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, weights, packed_modules_mapping=self.packed_modules_mapping, mapper=self.weights_mapper,
                     quant=self.config.quantization, tied_lm_head=self.config.tie_word_embeddings)


class Mistral3ForConditionalGeneration(LlamaForCausalLM):
    """Mistral-Small-3.x, Magistral, Devstral: a Mistral text model under a vision tower, served as text."""

    weights_mapper = VL_TEXT_MAPPER
