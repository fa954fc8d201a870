"""GLM-4.5 / GLM-4.5-Air (Glm4MoeForCausalLM): the Llama layer stack with shared experts and dense first layers.

Differences from Llama, all read from ModelConfig: QKV bias, partial rotary (`partial_rotary_factor`, rotate-half
on the first share of head_dim, from the RoPE factory), optional q/k norm (`use_qk_norm`), the first
`first_k_dense_replace` layers dense, and MoE blocks with sigmoid routing, a score-correction bias, group-limited
choice, a routed scaling factor and `n_shared_experts` shared experts. The published checkpoints also carry
`num_nextn_predict_layers` multi-token-prediction layers after the last one; they are skipped, not loaded.
"""
from __future__ import annotations

from engine.config.model import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3_moe import moe_block
from engine.models.weights import WeightsMapper


class Glm4MoeForCausalLM(LlamaForCausalLM):
    mlp_factory = moe_block

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        super().__init__(cfg, backend)
        mtp = int(cfg.hf_text_config.get("num_nextn_predict_layers") or 0)
        self.weights_mapper = WeightsMapper(skipped_prefixes=tuple(
            f"model.layers.{cfg.num_layers + i}." for i in range(mtp)))
