"""Qwen3-Next: the hybrid decoder — Gated DeltaNet layers (engine/layers/gated_deltanet.py) with a
per-sequence state, and every fourth layer (`layer_types`) gated full attention over the paged KV cache.

What differs from Llama besides the DeltaNet layers: (1 + w) RMSNorms everywhere (HF's Qwen3NextRMSNorm,
computed as Gemma's), q/k norms, an output gate in q_proj ([query | gate] per head, out * sigmoid(gate)
before o_proj), partial rotary (a quarter of head_dim by default), and a sparse MoE block with a
sigmoid-gated shared expert on the MoE layers (`decoder_sparse_step`, `mlp_only_layers`). Qwen3.5
(engine/models/qwen3_5.py) is this decoder with its own projection names and mRoPE text positions.
"""
from __future__ import annotations

from typing import Iterable
import logging

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.fused_moe import RouterSpec, SparseMoeBlock
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RotaryEmbedding, rotary_embeddings
from engine.layers.embedding import VocabParallelEmbedding
from engine.config.model import ModelConfig
from engine.config.speculative import MTP_PREFIX  # the head is kept in the checkpoint for speculative decoding
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.models.weights import WeightsMapper, checkpoint_modules

logger = logging.getLogger("pagedesk.engine")

# HF's shared expert and its gate, under our SharedExperts names.
SHARED_EXPERT_INFIXES = ((".mlp.shared_expert_gate.weight", ".mlp.shared_experts.gate"),
                         (".mlp.shared_expert.", ".mlp.shared_experts."))


class GatedAttention(nn.Module):
    """Full attention with q/k (1 + w) norms and an output gate carried in q_proj."""

    def __init__(self, cfg: ModelConfig, layer: int, backend: str, rotary_emb: RotaryEmbedding,
                 packed: dict) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.self_attn"
        # q_proj holds 2 * head_dim per head ([query | gate]): heads of twice the size split the same way.
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, 2 * cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, cfg.quantization, prefix,
                                          checkpoint_modules(packed, "qkv_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.qkv_bias,
                                        cfg.quantization, prefix, ("o_proj",))
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, None, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * q_size, kv_size, kv_size], dim=-1)
        q, gate = qg.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta, gate=gate)
        return self.o_proj(out.reshape(-1, q_size))


def hybrid_mlp(cfg: ModelConfig, layer: int, packed: dict) -> nn.Module:
    """The MoE block (shared expert with a sigmoid gate) on MoE layers, else the dense MLP."""
    moe = cfg.moe
    if moe is None or layer not in moe.moe_layers:
        return LlamaMLP(cfg, layer, packed)
    return SparseMoeBlock(RouterSpec(**moe.router_spec_kwargs()), cfg.hidden_size, moe.intermediate_size,
                          activation=moe.activation, shared_intermediate_size=moe.shared_intermediate_size,
                          shared_gate=moe.shared_gate, quant=cfg.quantization,
                          prefix=f"model.layers.{layer}.mlp")


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: str, rotary_emb: RotaryEmbedding, packed: dict,
                 split_projections: bool) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[layer] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_attention, cfg.rms_norm_eps,
                                             f"model.layers.{layer}.linear_attn", cfg.quantization,
                                             split_projections, backend, cfg.hidden_act)
        else:
            self.self_attn = GatedAttention(cfg, layer, backend, rotary_emb, packed)
        self.mlp = hybrid_mlp(cfg, layer, packed)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, meta) if self.is_linear else self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class HybridModel(nn.Module):
    split_projections = False

    def __init__(self, cfg: ModelConfig, backend: str, packed: dict, mlp_factory=None) -> None:
        super().__init__()
        if cfg.linear_attention is None:
            raise ValueError(f"{cfg.architecture}: the config has no linear_attention layers (layer_types)")
        if cfg.sliding_windows and any(cfg.sliding_windows):
            raise ValueError(f"{cfg.architecture}: sliding-window layers are not supported in a hybrid model")
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        ropes = rotary_embeddings(cfg)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(cfg, i, backend, ropes["full_attention"], packed, self.split_projections)
            for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class Qwen3NextForCausalLM(LlamaForCausalLM):
    model_class = HybridModel
    weights_mapper = WeightsMapper(skipped_prefixes=(MTP_PREFIX,), renamed_infixes=SHARED_EXPERT_INFIXES)

    def attention_layers(self) -> list[PagedAttention]:
        """The full-attention layers, in order: the KV cache groups number these (engine/kv/kv_cache_interface.py)."""
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    def state_layers(self) -> list[GatedDeltaNet]:
        """The linear-attention layers, in order: each gets its slice of the state pool."""
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skipped = []

        def without_mtp(pairs):
            for name, tensor in pairs:
                if name.startswith(MTP_PREFIX):  # kept aside: the speculative-decoding head, not loaded here
                    skipped.append(name)
                    continue
                yield name, tensor

        super().load_weights(without_mtp(weights))
        if skipped:
            logger.info("%s: %d multi-token-prediction tensors (mtp.*) are not the target's (speculative method "
                        "\"mtp\" loads them as its head)", self.config.architecture, len(skipped))
        self.skipped_mtp_tensors = skipped
