"""Published config.json values of the MoE checkpoints the planner is asked about (literal dicts, no download).

Torch-free: `pagedesk-bench moe --planner-only` and tests/test_moe_sizing.py read the same dicts.
"""
from __future__ import annotations

AWQ_G128 = {"bits": 4, "group_size": 128, "modules_to_not_convert": ["gate"], "quant_method": "awq",
            "version": "gemm", "zero_point": True}

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-05, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "intermediate_size": 2880,
    "num_attention_heads": 64, "num_hidden_layers": 24, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088, "max_position_embeddings": 131072,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True,
    "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                                           "truncate": False},
    "swiglu_limit": 7.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}

GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 4096, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_attention_heads": 96, "num_hidden_layers": 46, "num_key_value_heads": 8,
    "head_dim": 128, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False,
    "vocab_size": 151552, "max_position_embeddings": 131072, "rope_theta": 1000000, "rms_norm_eps": 1e-05,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

# (name, config, tensor-parallel cards): the verdicts issue 21 asks for.
PLANNER_CASES = [
    ("Qwen3-30B-A3B-AWQ", {**QWEN3_30B_A3B, "quantization_config": AWQ_G128}, 1),
    ("Qwen3-30B-A3B bf16", QWEN3_30B_A3B, 2),
    ("gpt-oss-20b (MXFP4 experts)", GPT_OSS_20B, 1),
    ("Mixtral-8x7B-Instruct-AWQ", {**MIXTRAL_8X7B, "quantization_config": AWQ_G128}, 2),
    ("GLM-4.5-Air-AWQ", {**GLM_45_AIR, "quantization_config": AWQ_G128}, 2),
]
