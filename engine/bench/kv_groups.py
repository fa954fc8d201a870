"""`pagedesk-bench kv-groups`: what freeing sliding-window blocks buys, from the planner's own arithmetic.

Gemma-3-27B's published text config (written out below, nothing downloaded) through
`engine.planning.planner.plan_capacity` with window freeing on (KV cache groups: 10 full-attention layers, 52
window layers of 1,024 tokens) and off (every layer keeps every block), on one and two 24 GiB cards, bf16 and
4-bit (AWQ/GPTQ) weights, bf16 and FP8 KV.
"""
from __future__ import annotations

import argparse

# google/gemma-3-27b-it config.json, text_config (the fields the planner reads); layer i is full attention
# when (i + 1) % 6 == 0 (sliding_window_pattern 6): 10 full layers, 52 window layers.
GEMMA3_27B_TEXT = {
    "architectures": ["Gemma3ForCausalLM"], "hidden_size": 5376, "intermediate_size": 21504,
    "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
    "vocab_size": 262208, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "sliding_window": 1024, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)],
}


def gemma3_27b():
    """The ModelConfig of GEMMA3_27B_TEXT, built field by field (the registry of model families reads the same
    dict through ModelConfig.from_hf_config once Gemma 3 is a supported architecture)."""
    from engine.config.model import ModelConfig
    hf = GEMMA3_27B_TEXT
    return ModelConfig(
        architecture=hf["architectures"][0], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"],
        intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_position_embeddings=hf["max_position_embeddings"], rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=hf["rope_theta"], tie_word_embeddings=hf["tie_word_embeddings"], qk_norm=True,
        sliding_windows=[hf["sliding_window"] if t == "sliding_attention" else None for t in hf["layer_types"]],
        torch_dtype=hf["torch_dtype"], max_model_len=hf["max_position_embeddings"])


def rows(max_num_batched_tokens: int) -> list[str]:
    from engine.planning.planner import plan_capacity
    from engine.planning.units import GIB
    cfg = gemma3_27b()
    out = []
    for tp in (1, 2):
        for weights, quant in (("bf16", None), ("4-bit AWQ/GPTQ", "awq")):
            for kv in ("auto", "fp8"):
                plans = [plan_capacity(cfg, [24 * GIB] * tp, 0.9, dtype="bfloat16", kv_cache_dtype=kv,
                                       tensor_parallel_size=tp, quantization=quant,
                                       max_num_batched_tokens=max_num_batched_tokens, window_freeing=freeing)
                         for freeing in (False, True)]
                off, on = plans
                gain = f"{on.num_tokens / off.num_tokens:.1f}×" if off.num_tokens else "—"
                out.append(f"| {tp} × 24 GiB | {weights} | {'bf16' if kv == 'auto' else 'fp8'} | "
                           f"{on.weights_bytes / GIB:.1f} GiB | {max(0, on.kv_budget_bytes) / GIB:.2f} GiB | "
                           f"{off.num_tokens:,} | {on.num_tokens:,} | {gain} | {off.num_full_seqs} / {on.num_full_seqs} |")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench kv-groups", description=__doc__.split("\n")[0])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    print(f"\nGemma-3-27B, gpu_memory_utilization 0.9, max_num_batched_tokens {args.max_num_batched_tokens}, "
          "block size 16")
    print("\n| cards | weights | KV dtype | weights/card | KV budget/card | longest context, no freeing | "
          "longest context, window freeing | gain | 131,072-token sequences (off / on) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows(args.max_num_batched_tokens):
        print(row)
