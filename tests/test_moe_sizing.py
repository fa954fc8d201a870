"""MoE arithmetic of the planner from published configs: total vs active parameters, every expert in memory.

Torch-free paths only (engine/config/moe.py, engine/config/model.py, engine/planning/).
"""
from __future__ import annotations

import pytest

from engine.bench.moe_configs import AWQ_G128, GLM_45_AIR, MIXTRAL_8X7B, QWEN3_30B_A3B
from engine.config.model import ModelConfig
from engine.quantization.config import parse_quantization_config
from engine.planning.planner import plan_capacity
from engine.planning.units import GIB


@pytest.mark.parametrize("hf,total,active", [(QWEN3_30B_A3B, 30.5, 3.3), (MIXTRAL_8X7B, 46.7, 12.9),
                                             (GLM_45_AIR, 106.9, 13.4)], ids=["qwen3-30b-a3b", "mixtral", "glm"])
def test_total_and_active_parameters_match_the_published_counts(hf, total, active):
    cfg = ModelConfig.from_hf_config(hf)
    assert abs(cfg.num_params / 1e9 - total) < 0.06
    assert abs(cfg.num_active_params / 1e9 - active) < 0.06  # Qwen's "3.3B activated" is 3.35B


def test_layer_kinds_from_each_family():
    glm = ModelConfig.from_hf_config(GLM_45_AIR).moe
    assert glm.moe_layers == tuple(range(1, 46)) and glm.shared_intermediate_size == 1408
    assert glm.scoring == "sigmoid" and glm.correction_bias
    qwen = ModelConfig.from_hf_config({**QWEN3_30B_A3B, "mlp_only_layers": [0], "decoder_sparse_step": 2}).moe
    assert qwen.moe_layers == tuple(range(1, 48, 2)) and qwen.renormalize
    assert ModelConfig.from_hf_config(MIXTRAL_8X7B).moe.intermediate_size == 14336


def test_all_experts_count_in_weight_memory():
    """bf16 Qwen3-30B-A3B: ~61 GB of weights, so not even two 24 GB cards hold it (the AWQ build fits one)."""
    cfg = ModelConfig.from_hf_config(QWEN3_30B_A3B)
    two = plan_capacity(cfg, [24 * GIB] * 2, 0.9, dtype="bfloat16", tensor_parallel_size=2)
    assert 28 < two.weights_bytes / GIB < 29 and not two.fits
    awq = ModelConfig.from_hf_config({**QWEN3_30B_A3B, "quantization_config": AWQ_G128})
    one = plan_capacity(awq, [24 * GIB], 0.9, dtype="bfloat16")
    assert 15 < one.weights_bytes / GIB < 17 and one.fits


def test_mxfp4_keeps_attention_float_by_pattern():
    q = parse_quantization_config({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"]}})
    assert q.weight_type == "mxfp4" and q.group_size == 32
    assert q.is_ignored("model.layers.3.self_attn.q_proj") and q.is_ignored("model.layers.0.mlp.router")
    assert not q.is_ignored("model.layers.3.mlp.experts")
