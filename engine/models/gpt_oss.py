"""gpt-oss (GptOssForCausalLM), its attention half: the attention module and a decoder layer with an MLP slot.

Attention differs from Llama's in three ways, all handled below the family: learned per-head sinks (one more
logit per head in the softmax denominator, no value; PagedAttention owns the parameter and splits it by head
under tensor parallel), sliding-window (128) and global layers alternating from the first, and YaRN RoPE
(engine/layers/rotary.py). q/k/v and o projections carry biases. The experts are the shared MoE block
(engine/layers/fused_moe) with gpt-oss's switches: top-k of the router logits (with a router bias) then a
softmax over those k, expert biases, and the clamped SwiGLU. The checkpoint stores each projection stacked over
experts and transposed, gate and up interleaved (`experts.gate_up_proj` [E, H, 2I]); `load_weights` turns
those into the gate, up and down tensors the experts' loader takes. The published MXFP4 checkpoints
(quantization_config `mxfp4`) store the same projections as `*_blocks` [E, N, K/32, 16] bytes (32 E2M1 codes
per row of 16) and `*_scales` [E, N, K/32] E8M0, output rows first, gate/up rows interleaved: they are split the
same way and flattened to [E, N, K/2] bytes, and stay packed (engine/layers/fused_moe).
"""
from __future__ import annotations

import torch
from torch import nn

from typing import Iterable

from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.fused_moe.weights import split_interleaved_gate_up
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rotary_embeddings
from engine.config.model import ModelConfig
from engine.models.llama import LlamaForCausalLM, LlamaModel
from engine.models.qwen3_moe import moe_block
from engine.models.weights import WeightsMapper, checkpoint_modules


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


class GptOssModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, backend: str, packed: dict, mlp_factory) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        ropes = rotary_embeddings(cfg)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(cfg, i, backend, ropes[cfg.layer_types[i]], packed, mlp_factory(cfg, i, packed))
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel
    mlp_factory = moe_block
    weights_mapper = WeightsMapper(renamed_infixes=((".mlp.router.", ".mlp.gate."),))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(unstack_experts(weights))


def unstack_experts(weights: Iterable[tuple[str, torch.Tensor]]):
    """gpt-oss's stacked expert tensors as gate/up/down tensors over all experts, in our [E, N, K] layout (MXFP4:
    [E, N, K/2] bytes and [E, N, K/32] scales)."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".experts.")
        if not prefix:
            yield name, tensor
        elif leaf in ("gate_up_proj", "gate_up_proj_bias"):
            gate, up = split_interleaved_gate_up(tensor)
            kind = "weight" if leaf == "gate_up_proj" else "bias"
            yield f"{prefix}.experts.gate_proj.{kind}", gate
            yield f"{prefix}.experts.up_proj.{kind}", up
        elif leaf == "down_proj":
            yield f"{prefix}.experts.down_proj.weight", tensor.transpose(1, 2).contiguous()
        elif leaf == "down_proj_bias":
            yield f"{prefix}.experts.down_proj.bias", tensor
        elif leaf in MXFP4_LEAVES:
            proj, kind = MXFP4_LEAVES[leaf]
            packed = _mxfp4_rows(name, tensor, kind)
            if proj == "gate_up_proj":  # output rows interleaved gate, up, gate, ...
                yield f"{prefix}.experts.gate_proj.{kind}", packed[:, 0::2].contiguous()
                yield f"{prefix}.experts.up_proj.{kind}", packed[:, 1::2].contiguous()
            else:
                yield f"{prefix}.experts.down_proj.{kind}", packed
        else:
            raise ValueError(f"checkpoint tensor {name!r}: gpt-oss expert tensor {leaf!r} is not one of "
                             "gate_up_proj[_bias|_blocks|_scales], down_proj[_bias|_blocks|_scales]")


MXFP4_LEAVES = {f"{proj}_{kind}": (proj, kind) for proj in ("gate_up_proj", "down_proj")
                for kind in ("blocks", "scales")}


def _mxfp4_rows(name: str, tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """[E, N, K/32, 16] blocks -> [E, N, K/2] bytes; [E, N, K/32] scales as they are; checked."""
    if tensor.dtype != torch.uint8:
        raise ValueError(f"checkpoint tensor {name!r}: MXFP4 {kind} have dtype {tensor.dtype}, expected uint8")
    if kind == "blocks":
        if tensor.dim() != 4 or tensor.shape[-1] != 16:
            raise ValueError(f"checkpoint tensor {name!r}: MXFP4 blocks of shape {tuple(tensor.shape)}, expected "
                             "[experts, rows, groups, 16] (16 bytes = 32 FP4 values per group)")
        return tensor.flatten(2)
    if tensor.dim() != 3:
        raise ValueError(f"checkpoint tensor {name!r}: MXFP4 scales of shape {tuple(tensor.shape)}, expected "
                         "[experts, rows, groups]")
    return tensor
