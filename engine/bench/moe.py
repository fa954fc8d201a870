"""`pagedesk-bench moe`: a tiny MoE against a dense model with the same active parameters on CPU, and the
planner's verdicts for the MoE checkpoints people run on 24 GB cards.

The MoE is a random Qwen3-MoE (16 experts, top-2, expert size 384); the dense model is the Qwen3 with the same
attention and an MLP of 2 × 384, so a token goes through the same matrix sizes in both; the MoE holds 8× the
MLP weights and pays for routing and per-expert gathers. Both serve the same ShareGPT-like requests (greedy,
fixed lengths). The verdicts come from published config.json values (engine/bench/moe_configs.py).
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from engine.bench.moe_configs import PLANNER_CASES

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             vocab_size=8192, max_position_embeddings=2048, tie_word_embeddings=False)
MOE = dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=384, intermediate_size=768,
           norm_topk_prob=True)


def planner_verdicts() -> None:
    from engine.config.model import ModelConfig
    from engine.planning.planner import plan_capacity
    from engine.planning.units import GIB
    print("\n| model | params (total / active) | cards | weights/card | KV tokens that fit | verdict at the "
          "model's context |")
    print("|---|---|---|---:|---:|---|")
    for name, hf, tp in PLANNER_CASES:
        try:
            cfg = ModelConfig.from_hf_config(hf)
        except ValueError as exc:  # an architecture this build does not serve yet: say so in the table
            print(f"| {name} | | {tp} × 24 GiB | | | not planned: {exc} |")
            continue
        plan = plan_capacity(cfg, [24 * GIB] * tp, 0.9, dtype="bfloat16", tensor_parallel_size=tp)
        if plan.fits:
            verdict = f"fits {plan.num_full_seqs} × {plan.max_model_len:,}"
        elif plan.num_tokens > 0:
            verdict = f"weights fit; does not fit one {plan.max_model_len:,}-token sequence"
        else:
            verdict = "does not fit: the weights alone exceed the cards"
        params = f"{cfg.num_params / 1e9:.1f}B / {cfg.num_active_params / 1e9:.1f}B"
        print(f"| {name} | {params} | {tp} × 24 GiB, 0.9 | {plan.weights_bytes / GIB:.2f} GiB | "
              f"{plan.num_tokens:,} | {verdict} |")


def throughput(num_prompts: int, max_model_len: int) -> None:
    import torch

    from engine import LLM, SamplingParams
    from engine.bench.random_model import make_random_model
    from engine.bench.workload import sharegpt_like
    from engine.config.model import ModelConfig
    requests = sharegpt_like(num_prompts, SHAPE["vocab_size"], max_model_len, 0, prompt_mean=64, output_mean=64)
    out_tokens = sum(r.output_len for r in requests)
    print(f"\n{num_prompts} requests, {out_tokens} output tokens; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}\n")
    print("| model | params (total / active) | seconds | output tok/s |")
    print("|---|---|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [("dense Qwen3, MLP 768", make_random_model(Path(tmp) / "dense", "Qwen3Config",
                                                               "Qwen3ForCausalLM", {**SHAPE, "intermediate_size": 768})),
                   ("Qwen3-MoE, 16 experts top-2 of 384", make_random_model(
                       Path(tmp) / "moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**SHAPE, **MOE}))]
        for name, path in folders:
            cfg = ModelConfig.from_folder(path)
            llm = LLM(str(path), device="cpu", max_model_len=max_model_len)
            params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
            start = time.perf_counter()
            llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            llm.engine.shutdown()
            print(f"| {name} | {cfg.num_params / 1e6:.1f}M / {cfg.num_active_params / 1e6:.1f}M | {elapsed:.1f} | "
                  f"{out_tokens / elapsed:.1f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench moe", description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--planner-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.planner_only:
        throughput(args.num_prompts, args.max_model_len)
    planner_verdicts()
