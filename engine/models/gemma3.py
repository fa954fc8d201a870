"""The Gemma 3 family: Gemma3ForCausalLM (1B text) and Gemma3ForConditionalGeneration (4B/12B/27B) served as text.

What differs from Llama: (1 + w) RMSNorm, four norms per layer (before and after attention and the MLP), GELU-tanh
MLP, the token embedding scaled by sqrt(hidden_size), q/k RMSNorm, attention scaled by query_pre_attn_scalar,
and two RoPE tables — local layers (sliding window, 5 of every 6) on their own base, global ones on the scaled
long-context base. A VL checkpoint keeps the text model under `language_model`; the weights mapper renames it and
skips the vision tower and projector on purpose, so they are never loaded. Gemma 2 (engine/models/gemma2.py) is
this decoder without the q/k norms and with soft-capped attention logits, both read from the config here.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RotaryEmbedding, rotary_embeddings
from engine.config.model import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.weights import (VL_TEXT_MAPPER, checkpoint_modules)

def check_supported(cfg: ModelConfig) -> None:
    text = cfg.hf_text_config
    if text.get("use_bidirectional_attention"):
        raise ValueError(f"{cfg.architecture}: use_bidirectional_attention (an embedding model) is not supported")
    if cfg.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"{cfg.architecture}: hidden_activation {cfg.hidden_act!r} is not supported "
                         "(gelu_pytorch_tanh only)")


class Gemma3Attention(nn.Module):
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
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None  # not in Gemma 2
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary_emb = rotary_emb  # shared by the layers of one kind (local or global)
        scale = float(cfg.hf_text_config.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.sliding_windows[layer],
                                   backend, scale=scale, soft_cap=cfg.hf_text_config.get("attn_logit_softcapping"))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta)
        return self.o_proj(out.reshape(-1, q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, packed: dict) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.mlp"
        width = cfg.layer_intermediate_size(layer)  # Gemma 4's KV-sharing layers may be double-wide
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [width] * 2, False,
                                                       cfg.quantization, prefix,
                                                       checkpoint_modules(packed, "gate_up_proj"))
        self.down_proj = RowParallelLinear(width, cfg.hidden_size, False, cfg.quantization, prefix,
                                           ("down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: str, rotary_emb: RotaryEmbedding,
                 packed: dict) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer, backend, rotary_emb, packed)
        self.mlp = Gemma3MLP(cfg, layer, packed)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions, x, residual, meta):
        """`x` is the previous layer's MLP output after its post-norm, still to be added to `residual`."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str, packed: dict, mlp_factory=None) -> None:  # Gemma has its own MLP
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5
        ropes = rotary_embeddings(cfg)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, backend, ropes[cfg.layer_types[i]], packed)
                                    for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)  # HF rounds the scale to the dtype
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        check_supported(cfg)
        super().__init__(cfg, backend)
        self.final_softcap = cfg.hf_text_config.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The VL checkpoint served as text: the same decoder, the vision tower and projector skipped."""

    weights_mapper = VL_TEXT_MAPPER
