"""`pagedesk-bench hybrid`: the planner's verdicts for the hybrid linear-attention checkpoints people run on
24 GB cards (Qwen3.6-27B and Qwen3.6-35B-A3B, AWQ 4-bit, FP8 KV), against dense-attention models of equal size.

The config values were first written from memory and then checked (2026-12-01) against published copies of
the model cards and config.json files (BENCHMARKS.md names the sources; nothing is downloaded here), and all
of them held (Qwen3.6 keeps Qwen3.5's architecture: model_type qwen3_5 / qwen3_5_moe): 27B: hidden 5120,
64 layers laid out 16 × (3 Gated DeltaNet + 1 gated attention), DeltaNet 16 QK heads / 48 V heads of 128,
attention 24 Q / 4 KV heads of 256, FFN 17408, vocab 248320, 262,144 tokens of context, rope_theta 1e7 with
partial rotary 0.25 and mRoPE sections [11, 11, 10], float32 mamba_ssm_dtype; 35B-A3B: hidden 2048, 40 layers
10 × (3 + 1), DeltaNet 16 / 32 heads of 128, attention 16 Q / 2 KV heads of 256, 256 experts of 512 with 8
routed + 1 shared of 512. The AWQ quantization_config is an assumption, not one published checkpoint's: 4-bit
group-128 on every decoder linear layer (published 4-bit Qwen3.6 quants often keep in_proj_a / in_proj_b, a
few MiB, or all DeltaNet projections in bf16). Plans count CUDA graphs as the app does by default
(full_and_piecewise: decode graphs, pieces up to the 8192-token step budget, the hybrid's padding state slot). The
dense comparisons are Qwen3-32B and Qwen3-30B-A3B (every layer full attention) planned at the same context.
The state pool counts a slot per seat (max_num_seqs) and the prefix cache's 4 state snapshots. The planner
part is torch-free. `--cpu` also serves a tiny random Qwen3.5 (3 DeltaNet layers of every 4) and
the dense Qwen3 of the same shape on CPU with the same requests (greedy, fixed lengths) and prints tokens/s.
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from engine.bench.moe_configs import QWEN3_30B_A3B

AWQ_G128 = {"bits": 4, "group_size": 128, "modules_to_not_convert": ["visual", "mtp", "mlp.gate"],
            "quant_method": "awq", "version": "gemm", "zero_point": True}
QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                "mrope_interleaved": True, "mrope_section": [11, 11, 10]}
QWEN3_6_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 17408,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "attn_output_gate": True,
        "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32", "max_position_embeddings": 262_144, "rms_norm_eps": 1e-6,
        "rope_parameters": QWEN3_5_ROPE, "vocab_size": 248_320, "dtype": "bfloat16"},
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5_vision"}}
QWEN3_6_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "attn_output_gate": True,
        "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262_144,
        "rms_norm_eps": 1e-6, "rope_parameters": QWEN3_5_ROPE, "vocab_size": 248_320, "dtype": "bfloat16"},
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5_moe_vision"}}
QWEN3_32B = {  # dense attention in every layer, the dense model of the 27B's size
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120, "intermediate_size": 25600,
    "num_attention_heads": 64, "num_hidden_layers": 64, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151_936, "max_position_embeddings": 40_960, "rope_theta": 1_000_000, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
CONTEXT = 262_144
HYBRID_CASES = [("Qwen3.6-27B AWQ", QWEN3_6_27B), ("Qwen3.6-35B-A3B AWQ", QWEN3_6_35B_A3B)]
DENSE_CASES = [("Qwen3-32B AWQ (dense attention)", QWEN3_32B), ("Qwen3-30B-A3B AWQ (dense attention)", QWEN3_30B_A3B)]
SEATS = (4, 16)  # max_num_seqs: the state pool holds one slot per seat


def plan(hf: dict, tp: int, max_num_seqs: int, images: bool = False):
    """The plan at CONTEXT tokens, AWQ weights, FP8 KV on `tp` 24 GiB cards at 0.9; served as text (the tower
    neither loaded nor run, as a folder without its image processor is served), or with `images` its tower,
    its peak at the largest image and its encoder cache (`pagedesk-bench images --planner`)."""
    import dataclasses

    from engine.config.model import ModelConfig
    from engine.planning.planner import plan_capacity
    from engine.planning.units import GIB
    hf = {**hf, "quantization_config": AWQ_G128}
    cfg = ModelConfig.from_hf_config(hf)
    if not images:
        cfg = dataclasses.replace(cfg, vision=None)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, CONTEXT)  # dense ones: planned as if extended
    return cfg, plan_capacity(cfg, [24 * GIB] * tp, 0.9, dtype="bfloat16", kv_cache_dtype="fp8", tensor_parallel_size=tp,
                              max_model_len=CONTEXT, max_num_seqs=max_num_seqs, cuda_graphs=True)


def verdict_rows() -> list[str]:
    from engine.planning.units import GIB, MIB
    rows = []
    for name, hf in HYBRID_CASES + DENSE_CASES:
        for tp in (1, 2):
            for seats in SEATS:
                cfg, p = plan(hf, tp, seats)
                if p.fits:
                    verdict = f"fits {p.num_full_seqs} × {CONTEXT:,}"
                elif p.num_tokens > 0:
                    verdict = f"{p.num_tokens:,} tokens: not one full {CONTEXT:,}-token sequence"
                else:
                    verdict = "does not fit"
                per_seq = p.layout.state_bytes_per_seq  # one seat's (or one snapshot's) slot
                rows.append(f"| {name} | {tp} × 24 GiB | {seats} | {p.weights_bytes / GIB:.2f} GiB | "
                            f"{p.state_bytes / GIB:.2f} GiB ({per_seq / MIB:.0f} MiB/seq) | "
                            f"{p.overhead_bytes / GIB:.2f} GiB | "
                            f"{p.kv_bytes_per_token / 1024:.0f} KiB | {p.num_tokens:,} | {verdict} |")
    return rows


CPU_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                 intermediate_size=1024, vocab_size=8192, max_position_embeddings=2048, tie_word_embeddings=False)
CPU_LINEAR = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                  linear_conv_kernel_dim=4, full_attention_interval=4)


def cpu_throughput(num_prompts: int, max_model_len: int) -> None:
    import torch

    from engine import LLM, SamplingParams
    from engine.bench.random_model import make_random_model
    from engine.bench.workload import sharegpt_like
    from engine.config.model import ModelConfig
    requests = sharegpt_like(num_prompts, CPU_SHAPE["vocab_size"], max_model_len, 0, prompt_mean=64, output_mean=64)
    out_tokens = sum(r.output_len for r in requests)
    print(f"\n{num_prompts} requests, {out_tokens} output tokens; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}\n")
    print("| model | params | seconds | output tok/s |")
    print("|---|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [("dense Qwen3, 8 full-attention layers", make_random_model(
                        Path(tmp) / "dense", "Qwen3Config", "Qwen3ForCausalLM", CPU_SHAPE)),
                   ("Qwen3.5, 6 Gated DeltaNet + 2 full-attention layers", make_random_model(
                        Path(tmp) / "hybrid", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**CPU_SHAPE, **CPU_LINEAR}))]
        for name, path in folders:
            cfg = ModelConfig.from_folder(path)
            llm = LLM(str(path), device="cpu", max_model_len=max_model_len, max_num_seqs=num_prompts)
            params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
            start = time.perf_counter()
            llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            llm.engine.shutdown()
            print(f"| {name} | {cfg.num_params / 1e6:.1f}M | {elapsed:.1f} | {out_tokens / elapsed:.1f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench hybrid", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="also serve a tiny hybrid and a dense model on CPU")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args(argv)
    if args.cpu:
        cpu_throughput(args.num_prompts, args.max_model_len)
        print()
    print("| model | cards (0.9) | max_num_seqs | weights/card | state pool/card | CUDA graphs/card | "
          "KV/token/card (FP8) | KV tokens that fit | verdict at 262,144 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for row in verdict_rows():
        print(row)
