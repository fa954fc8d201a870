"""gpt-oss (GptOssForCausalLM): the shared decoder with gpt-oss's attention switches and its experts.

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
same way and flattened to [E, N, K/2] bytes, and stay packed (engine/layers/fused_moe). A GGUF (llama.cpp's
`gpt-oss`) has them apart already, [E, N, K] in MXFP4 blocks, kept as the GGUF experts of the MoE kernel.
"""
from __future__ import annotations

from typing import Iterable

import torch

from engine.config.model import ModelConfig
from engine.layers.attention_block import AttentionSwitches, SelfAttention
from engine.layers.decoder import DecoderSwitches
from engine.layers.fused_moe.weights import split_interleaved_gate_up
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3_moe import moe_block
from engine.models.weights import LLAMA_GGUF_BLOCK, GgufNames, WeightsMapper

# llama.cpp's gpt-oss: the Llama names (biases as `.bias` leaves), its pre-MLP norm as post_attention_norm, the
# sinks as a bare tensor, and each expert projection stacked on its own (gate and up already apart), MXFP4
GPT_OSS_GGUF_NAMES = GgufNames({**LLAMA_GGUF_BLOCK, "post_attention_norm": "post_attention_layernorm",
                                "attn_sinks": "self_attn.sinks"}, bare=("attn_sinks",))


class GptOssForCausalLM(LlamaForCausalLM):
    mlp_factory = moe_block
    weights_mapper = WeightsMapper(renamed_infixes=((".mlp.router.", ".mlp.gate."),))
    gguf_names = {"gpt-oss": GPT_OSS_GGUF_NAMES}

    @staticmethod
    def decoder_switches(cfg: ModelConfig) -> DecoderSwitches:
        return DecoderSwitches(AttentionSwitches(qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, sinks=True))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(unstack_experts(weights))


class GptOssAttention(SelfAttention):
    """One layer's self-attention with gpt-oss's switches, as a unit (tests/test_family_gpt_oss_attention.py checks
    it against HF's GptOssAttention)."""

    def __init__(self, cfg: ModelConfig, layer: int, backend: str, rotary_emb: RotaryEmbedding,
                 packed: dict) -> None:
        super().__init__(cfg, layer, GptOssForCausalLM.decoder_switches(cfg).attention, rotary_emb, backend, packed)


def unstack_experts(weights: Iterable[tuple[str, torch.Tensor]]):
    """gpt-oss's stacked expert tensors as gate/up/down tensors over all experts, in our [E, N, K] layout (MXFP4:
    [E, N, K/2] bytes and [E, N, K/32] scales)."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".experts.")
        if not prefix or leaf.startswith(("gate_proj.", "up_proj.", "down_proj.")):  # a GGUF's: ours already
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
