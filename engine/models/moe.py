"""Mixture-of-experts decoders: Qwen3-MoE, Mixtral and GLM-4.5-style layers on the shared decoder.

Attention, norms, embeddings and the dense MLP are the decoder's (engine/models/decoder.py); a layer that
ModelConfig.moe lists gets a SparseMoeBlock (engine/layers/fused_moe) instead of the dense MLP, others
(`first_k_dense_replace`, `mlp_only_layers`) keep it. Checkpoint names: per-expert tensors go to the stacked
expert parameters (engine/layers/fused_moe/weights.py), Mixtral's `block_sparse_moe` is our `mlp`, and every
(expert, projection) pair must arrive or loading fails naming the first missing ones.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.fused_moe import RouterSpec, SparseMoeBlock
from engine.layers.fused_moe.weights import expert_shard
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderForCausalLM, DecoderMLP

RENAMES = {".block_sparse_moe.": ".mlp."}  # Mixtral


def moe_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    moe = cfg.moe
    if layer not in moe.moe_layers:
        return DecoderMLP(cfg, layer)
    if cfg.quantization is not None and not cfg.quantization.is_ignored(f"model.layers.{layer}.mlp.experts"):
        raise ValueError(f"{cfg.quantization.describe()} expert weights are not supported yet; MoE models load "
                         "from float checkpoints (the dense and attention layers of quantized ones are fine)")
    return SparseMoeBlock(RouterSpec(**moe.router_spec_kwargs()), cfg.hidden_size, moe.intermediate_size,
                          activation=moe.activation, expert_bias=moe.expert_bias, router_bias=moe.router_bias,
                          correction_bias=moe.correction_bias, router_fp32=moe.scoring == "sigmoid",
                          shared_intermediate_size=moe.shared_intermediate_size, quant=cfg.quantization,
                          prefix=f"model.layers.{layer}.mlp")


class MoeForCausalLM(DecoderForCausalLM):
    mlp_factory = moe_mlp

    def expert_layers(self) -> list:
        return [layer.mlp.experts for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def load_special(self, params: dict, hf_name: str, tensor: torch.Tensor, missing: set) -> bool:
        name = hf_name
        for old, new in RENAMES.items():
            name = name.replace(old, new)
        hit = expert_shard(name)
        if hit is None:
            if name == hf_name:
                return False
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint has a weight {hf_name!r} this model does not expect")
            param.data.copy_(tensor)
            missing.discard(name)
            return True
        param_name, expert_id, shard_id = hit
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"checkpoint has an expert weight {hf_name!r} this model does not expect")
        param.weight_loader(param, tensor, shard_id, expert_id)
        missing.discard(param_name)  # completeness is checked per (expert, shard) in missing_special
        return True

    def missing_special(self) -> list[str]:
        return [m for experts in self.expert_layers() for m in experts.missing_shards()]
