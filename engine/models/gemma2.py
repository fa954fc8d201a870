"""The Gemma 2 family (Gemma2ForCausalLM): Llama's projections with Gemma's own arithmetic around them.

What differs from engine/models/llama.py: embeddings scaled by sqrt(hidden_size) (rounded to the model dtype,
as HF does), (1 + w) RMSNorms in fp32 (engine/layers/norm.py), four norms per layer (the attention and the MLP
outputs are normed before each residual add), a GELU-tanh MLP, attention scaled by
``query_pre_attn_scalar ** -0.5`` instead of head_dim's, attention logits soft-capped
(``cap * tanh(s / cap)``, every backend: kernels/) and the final logits soft-capped the same way. Layers
alternate sliding-window (even) and global (odd) attention; ModelConfig reads that from `layer_types`, or
from the registry's `sliding_window_pattern` default when a config.json has none. Embeddings are tied.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RotaryEmbedding, rotary_embeddings
from engine.model_config import ModelConfig
from engine.models.weights import PACKED_QKV_GATE_UP, WeightsMapper, checkpoint_modules, load_weights

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")  # HF's names for tanh-approximated GELU


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class Gemma2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: str, rotary_emb: RotaryEmbedding,
                 packed: dict) -> None:
        super().__init__()
        text = cfg.hf_text_config
        prefix = f"model.layers.{layer}.self_attn"
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, cfg.quantization, prefix,
                                          checkpoint_modules(packed, "qkv_proj"))
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, \
            cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.qkv_bias,
                                        cfg.quantization, prefix, ("o_proj",))
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.sliding_windows[layer],
                                   backend, scale=float(text["query_pre_attn_scalar"]) ** -0.5,
                                   soft_cap=text.get("attn_logit_softcapping"))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q.view(-1, self.num_heads, self.head_dim),
                               k.view(-1, self.num_kv_heads, self.head_dim))
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta)
        return self.o_proj(out.reshape(-1, q_size))


class Gemma2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, packed: dict) -> None:
        super().__init__()
        if cfg.hidden_act not in GELU_TANH:
            raise ValueError(f"hidden_activation {cfg.hidden_act!r} is not supported by the {cfg.architecture} "
                             f"family ({', '.join(GELU_TANH)})")
        prefix = f"model.layers.{layer}.mlp"
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False,
                                                       cfg.quantization, prefix,
                                                       checkpoint_modules(packed, "gate_up_proj"))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, cfg.quantization, prefix,
                                           ("down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: str, rotary_emb: RotaryEmbedding,
                 packed: dict) -> None:
        super().__init__()
        self.self_attn = Gemma2Attention(cfg, layer, backend, rotary_emb, packed)
        self.mlp = Gemma2MLP(cfg, layer, packed)
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str, packed: dict) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5
        ropes = rotary_embeddings(cfg)
        self.layers = nn.ModuleList(Gemma2DecoderLayer(cfg, i, backend, ropes[cfg.layer_types[i]], packed)
                                    for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # sqrt(3584) is 60.0 in bf16, as in HF
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class Gemma2ForCausalLM(nn.Module):
    packed_modules_mapping = PACKED_QKV_GATE_UP
    weights_mapper = WeightsMapper()

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        super().__init__()
        self.config = cfg
        self.final_logit_softcapping = cfg.hf_text_config.get("final_logit_softcapping")
        self.model = Gemma2Model(cfg, backend, self.packed_modules_mapping)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head.logits(hidden), self.final_logit_softcapping)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, weights, packed_modules_mapping=self.packed_modules_mapping, mapper=self.weights_mapper,
                     quant=self.config.quantization, tied_lm_head=self.config.tie_word_embeddings)
