"""The quantization everywhere outside the layers: planner bytes, GUI model info, /v1/models and /metrics.

The planner counts weights at their packed size from the folder's quantization_config (bits, group size,
zero points); the two published configs below are copied as literal dicts (nothing can be downloaded).
"""
from __future__ import annotations

import httpx

from app.model_info import read_model_info
from engine.config.model import ModelConfig
from engine.planning.weights import weights_bytes_per_card
from engine.planning.planner import plan_capacity
from engine.planning.units import GIB
from quant_packers import make_quantized
from server_harness import start_server

AWQ_G128 = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
            "zero_point": True}
QWEN25_32B_AWQ = {  # Qwen/Qwen2.5-32B-Instruct-AWQ config.json
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 5120, "intermediate_size": 27648,
    "num_attention_heads": 40, "num_hidden_layers": 64, "num_key_value_heads": 8, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "sliding_window": 131072,
    "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "float16",
    "quantization_config": AWQ_G128}
LLAMA33_70B_AWQ = {  # an AWQ export of meta-llama/Llama-3.3-70B-Instruct (gemm, 4-bit, group 128)
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "float16", "quantization_config": AWQ_G128}
CARD_24G = 24 * GIB


def test_planner_counts_packed_bytes_with_zero_points():
    cfg = ModelConfig.from_hf_config(QWEN25_32B_AWQ)
    # Matrices: 31,205,621,760 weights → 4-bit codes 15,602,810,880 B; 243,793,920 groups of 128, each kept in
    # memory as a float16 scale and a one-byte zero point = 3 B → 731,381,760 B. Embeddings, biases and norms
    # stay 16-bit: (1,557,135,360 + 458,752 + 660,480) · 2 = 3,116,509,184 B.
    assert weights_bytes_per_card(cfg, 2) == 15_602_810_880 + 731_381_760 + 3_116_509_184
    float_cfg = ModelConfig.from_hf_config({k: v for k, v in QWEN25_32B_AWQ.items() if k != "quantization_config"})
    assert weights_bytes_per_card(float_cfg, 2) > 3.3 * weights_bytes_per_card(cfg, 2)


def test_planner_verdicts_for_24gb_cards():
    qwen = plan_capacity(ModelConfig.from_hf_config(QWEN25_32B_AWQ), [CARD_24G], 0.9, dtype="float16")
    assert round(qwen.weights_bytes / GIB, 2) == 18.13 and not qwen.fits  # 32,768 tokens do not fit one card
    assert qwen.num_tokens == 1_952 and "Lower --max-model-len to 1,952" in qwen.explain_misfit()
    llama = plan_capacity(ModelConfig.from_hf_config(LLAMA33_70B_AWQ), [CARD_24G] * 2, 0.9, dtype="float16",
                          tensor_parallel_size=2, max_model_len=2048)
    # 18.71 GiB a card with a byte per zero point and float16 scales as kept in memory: 3,648 tokens of KV
    assert 18 < llama.weights_bytes / GIB < 19.5 and llama.fits and llama.num_tokens == 3_648


def test_model_info_names_method_bits_and_group(tiny_model_dir, tmp_path):
    path = make_quantized(tiny_model_dir("llama"), tmp_path / "awq", "gptq", 8, 32, True, True)
    info = read_model_info(path)
    assert info.describe().endswith("· float32 · gptq 8-bit g32 act-order")
    assert info.num_parameters == read_model_info(tiny_model_dir("llama")).num_parameters  # codes, not words
    assert read_model_info(tiny_model_dir("llama")).quantization is None


def test_models_route_and_metrics_name_the_quantization(tiny_model_dir, tmp_path):
    path = make_quantized(tiny_model_dir("llama"), tmp_path / "awq", "awq", 4, 32, False, False)
    server = start_server(path)
    try:
        card = httpx.get(server.base_url + "/models").json()["data"][0]
        assert card["quantization"] == "awq 4-bit g32 asym"
        metrics = httpx.get(server.url + "/metrics").text
        assert 'pagedesk:model_info{model_name="tiny",quantization="awq 4-bit g32 asym"} 1.0' in metrics
    finally:
        server.stop()
