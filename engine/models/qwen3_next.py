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

from engine.config.model import ModelConfig
from engine.layers.attention_block import AttentionSwitches
from engine.layers.decoder import DecoderSwitches
from engine.layers.fused_moe import RouterSpec, SparseMoeBlock
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.config.speculative import MTP_PREFIX  # the head is kept in the checkpoint for speculative decoding
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.models.weights import WeightsMapper

logger = logging.getLogger("pagedesk.engine")

# HF's shared expert and its gate, under our SharedExperts names.
SHARED_EXPERT_INFIXES = ((".mlp.shared_expert_gate.weight", ".mlp.shared_experts.gate"),
                         (".mlp.shared_expert.", ".mlp.shared_experts."))


def hybrid_mlp(cfg: ModelConfig, layer: int, packed: dict) -> nn.Module:
    """The MoE block (shared expert with a sigmoid gate) on MoE layers, else the dense MLP."""
    moe = cfg.moe
    if moe is None or layer not in moe.moe_layers:
        return LlamaMLP(cfg, layer, packed)
    return SparseMoeBlock(RouterSpec(**moe.router_spec_kwargs()), cfg.hidden_size, moe.intermediate_size,
                          activation=moe.activation, shared_intermediate_size=moe.shared_intermediate_size,
                          shared_gate=moe.shared_gate, quant=cfg.quantization,
                          prefix=f"model.layers.{layer}.mlp")


class Qwen3NextForCausalLM(LlamaForCausalLM):
    mlp_factory = hybrid_mlp
    weights_mapper = WeightsMapper(skipped_prefixes=(MTP_PREFIX,), renamed_infixes=SHARED_EXPERT_INFIXES)
    split_projections = False  # the DeltaNet's input projections: fused (Qwen3-Next) or stored split (Qwen3.5)

    @staticmethod
    def decoder_switches(cfg: ModelConfig) -> DecoderSwitches:
        """Gated full attention with (1 + w) q/k norms; (1 + w) norms everywhere (HF's Qwen3NextRMSNorm)."""
        attention = AttentionSwitches(qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=GemmaRMSNorm,
                                      output_gate=True)
        return DecoderSwitches(attention, norm=GemmaRMSNorm)

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        if cfg.linear_attention is None:
            raise ValueError(f"{cfg.architecture}: the config has no linear_attention layers (layer_types)")
        if cfg.sliding_windows and any(cfg.sliding_windows):
            raise ValueError(f"{cfg.architecture}: sliding-window layers are not supported in a hybrid model")
        super().__init__(cfg, backend)

    def token_mixer(self, cfg: ModelConfig, layer: int, ropes: dict[str, RotaryEmbedding],
                    backend: str) -> nn.Module:
        """A Gated DeltaNet on the linear-attention layers, the gated self-attention on the others."""
        if cfg.layer_types[layer] != "linear_attention":
            return super().token_mixer(cfg, layer, ropes, backend)
        return GatedDeltaNet(cfg.hidden_size, cfg.linear_attention, cfg.rms_norm_eps,
                             f"model.layers.{layer}.linear_attn", cfg.quantization, self.split_projections, backend,
                             cfg.hidden_act)

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
