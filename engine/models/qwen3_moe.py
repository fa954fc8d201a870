"""Mixture-of-experts decoders on the Llama layer stack: Qwen3-MoE and Mixtral.

Attention, norms and embeddings are the Llama family's (engine/models/llama.py); a layer that ModelConfig.moe
lists gets a SparseMoeBlock (engine/layers/fused_moe) in place of the dense MLP, the others
(`mlp_only_layers`, `decoder_sparse_step`) keep it. Per-expert checkpoint tensors load into the stacked expert
parameters (engine/models/weights.py routes them); Mixtral's `block_sparse_moe` is our `mlp`.
"""
from __future__ import annotations

from torch import nn

from engine.layers.fused_moe import RouterSpec, SparseMoeBlock
from engine.config.model import ModelConfig
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.models.weights import LLAMA_GGUF_NAMES, WeightsMapper


def moe_block(cfg: ModelConfig, layer: int, packed: dict) -> nn.Module:
    """The layer's MoE block, or the dense MLP for a layer the config keeps dense."""
    moe = cfg.moe
    if layer not in moe.moe_layers:
        return LlamaMLP(cfg, layer, packed)
    prefix = f"model.layers.{layer}.mlp"
    quant = cfg.quantization
    return SparseMoeBlock(RouterSpec(**moe.router_spec_kwargs()), cfg.hidden_size, moe.intermediate_size,
                          activation=moe.activation, expert_bias=moe.expert_bias, router_bias=moe.router_bias,
                          correction_bias=moe.correction_bias, router_fp32=moe.scoring == "sigmoid",
                          shared_intermediate_size=moe.shared_intermediate_size, quant=quant, prefix=prefix)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    mlp_factory = moe_block
    gguf_names = {"qwen3moe": LLAMA_GGUF_NAMES}  # experts stacked per projection: ffn_{gate,up,down}_exps


class MixtralForCausalLM(LlamaForCausalLM):
    mlp_factory = moe_block
    weights_mapper = WeightsMapper(renamed_infixes=((".block_sparse_moe.", ".mlp."),))
