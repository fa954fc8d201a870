"""`pagedesk-bench families`: the capacity planner's verdicts for the 2025-26 dense families on 24 GB cards.

Gemma-3-27B-it (bf16 and AWQ 4-bit), Phi-4 (bf16 and AWQ) and Mistral-Small-3.2-24B (AWQ) from their published
config.json files (literal dicts: the keys each file has, nothing downloaded; the AWQ quantization_config is
the usual 4-bit group-128 GEMM one), read by ModelConfig exactly as the engine reads a folder — the VL ones
through `text_config`, their vision towers counted whole on every card in bf16 (engine/planning/vision.py) — and
planned by engine/planning/planner.py
on one and two cards at --gpu-memory-utilization 0.9 with a 16-bit KV cache. Torch-free.
"""
from __future__ import annotations

import argparse

AWQ_G128 = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
            "zero_point": True}
GEMMA3_27B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {
        "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
        "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
PHI_4 = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 5120,
    "intermediate_size": 17920, "max_position_embeddings": 16384, "model_type": "phi3", "num_attention_heads": 40,
    "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 250000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 100352, "bos_token_id": 100257,
    "eos_token_id": 100265}
MISTRAL_SMALL_3_2 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
        "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
        "sliding_window": None, "vocab_size": 131072},
    "torch_dtype": "bfloat16",
    "vision_config": {"head_dim": 64, "hidden_size": 1024, "image_size": 1540, "intermediate_size": 4096,
                      "model_type": "pixtral", "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14}}
PUBLISHED = {
    "Gemma-3-27B-it (bf16)": GEMMA3_27B_IT,
    "Gemma-3-27B-it (AWQ)": {**GEMMA3_27B_IT, "quantization_config": AWQ_G128},
    "Phi-4 (bf16)": PHI_4,
    "Phi-4 (AWQ)": {**PHI_4, "quantization_config": AWQ_G128},
    "Mistral-Small-3.2-24B (AWQ)": {**MISTRAL_SMALL_3_2, "quantization_config": AWQ_G128},
}
CONTEXTS = (None, 32768, 8192)  # None: the model's own context (max_position_embeddings)


def verdict_rows(cards: tuple[int, ...] = (1, 2)) -> list[str]:
    from engine.config.model import ModelConfig
    from engine.planning.planner import plan_capacity
    from engine.planning.units import GIB
    rows = []
    for name, hf in PUBLISHED.items():
        cfg = ModelConfig.from_hf_config(hf)
        for tp in cards:
            for context in CONTEXTS:
                if context is not None and context >= cfg.max_position_embeddings:
                    continue
                plan = plan_capacity(cfg, [24 * GIB] * tp, 0.9, dtype="bfloat16", tensor_parallel_size=tp,
                                     max_model_len=context)
                verdict = f"fits {plan.num_full_seqs} × {plan.max_model_len:,}" if plan.fits else \
                    f"does not fit one {plan.max_model_len:,}-token sequence"
                rows.append(f"| {name} | {tp} × 24 GiB | {plan.max_model_len:,} | {plan.weights_bytes / GIB:.2f} GiB | "
                            f"{plan.kv_bytes_per_token / 1024:.0f} KiB | {plan.num_tokens:,} | {verdict} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench families", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    print("| model | cards (0.9) | max_model_len | weights/card | KV/token/card | KV tokens that fit | verdict |")
    print("|---|---|---:|---:|---:|---:|---|")
    for row in verdict_rows():
        print(row)
