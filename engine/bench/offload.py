"""`pagedesk-bench offload`: the prefix cache's CPU-RAM tier on a multi-turn session, the tier's reuse gate, and the
planner's context per KV-cache dtype.

`--section tier` (CPU, wall clock: a quiet machine): the bench Llama serves a session whose shared context (4K
tokens by default) fits the device pool once, another session's context pushes it out between the turns, and the
second turn re-sends it all. Its time to first token and the prompt tokens recomputed, with the tier and without.

`--section gate` (token counts, any machine): sessions of several turns with one-off prompts between them and a tier
that holds under two contexts; prompt tokens recomputed and restored from the tier when every freed block is stored
(min_uses 1) and when a block is stored only once a second sequence used it (min_uses 2, engine/kv/offload/
reuse_gate.py). A tiny model: the counts do not depend on the model.

`--section sleep` (wall clock): sleep mode on the same model: the seconds a start, a sleep and a wake take at
levels 1 and 2, and the device bytes each level frees (on a card, `--model` and `--device cuda`).

`--section planner` (torch-free): the context that fits on one and two 24 GiB cards per KV dtype (bf16, fp8, int8,
int4) for Qwen3.6-27B and Qwen3.6-35B-A3B (AWQ), Gemma-3-27B (AWQ) and gpt-oss-20b, and the host RAM a 64 GiB tier
adds in tokens.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

KV_DTYPES = ("auto", "fp8", "int8", "int4")  # auto: the weights' 16-bit dtype
TIER_GIB = 64.0


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]


def tier_section(context: int, question: int, model: str | None, device: str, kv_cache_dtype: str) -> None:
    """`model`: a checkpoint folder to serve instead of the bench Llama (the GPU figure)."""
    from engine import LLM, SamplingParams
    from engine.bench.random_model import BENCH_LLAMA, make_random_llama
    from engine.config.model import ModelConfig
    from engine.planning.units import GIB
    rng = random.Random(0)
    vocab = ModelConfig.from_folder(model).vocab_size if model else BENCH_LLAMA["vocab_size"]
    block = 16
    ctx, other = _prompt(rng, context, vocab), _prompt(rng, context, vocab)
    turn1 = ctx + _prompt(rng, question, vocab)
    blocks = -(-(context + 3 * question) // block) + 2  # one context and its turns: the other one evicts it
    first = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    print(f"\n{model or 'bench Llama'} on {device}, shared context {context:,} tokens, device pool {blocks} blocks of {block} "
          f"({blocks * block:,} tokens)\n")
    print("| tier | second-turn TTFT (s) | prompt tokens | recomputed | restored from the tier |")
    print("|---|---:|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = model or make_random_llama(Path(tmp) / "llama", max_position_embeddings=max(2048, context + 4 * question))
        ttft = {}
        for tier in (False, True):
            args = dict(device=device, num_gpu_blocks_override=blocks, max_num_seqs=1, block_size=block,
                        max_model_len=context + 4 * question, kv_cache_dtype=kv_cache_dtype)
            if tier:  # two contexts' blocks
                args["kv_offloading_size"] = 2 * blocks * block_bytes / GIB
            llm = LLM(str(path), **args)
            block_bytes = llm.engine.runner.kv_cache_bytes() // blocks
            answer = llm.generate([turn1], first, use_tqdm=False)[0].outputs[0].token_ids
            llm.generate([other], first, use_tqdm=False)  # the other session evicts the context
            turn2 = turn1 + list(answer) + _prompt(rng, question, vocab)
            start = time.perf_counter()
            out = llm.generate([turn2], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
            ttft[tier] = time.perf_counter() - start
            stats = llm.engine.kv.offload.snapshot_stats() if tier else None
            restored = stats.hit_tokens if stats else 0
            print(f"| {'on' if tier else 'off'} | {ttft[tier]:.2f} | {len(turn2):,} | "
                  f"{len(turn2) - out.num_cached_tokens:,} | {restored:,} |", flush=True)
            llm.engine.shutdown()
    print(f"\nsecond turn {ttft[False] / ttft[True]:.1f}× faster with the tier")


def gate_section(sessions: int, turns: int, context: int, one_offs: int, tier_contexts: float) -> None:
    from engine import LLM, SamplingParams
    from engine.bench.random_model import make_random_llama
    from engine.kv.offload.reuse_gate import ReuseGate
    from engine.planning.units import GIB
    block, vocab = 16, 512
    print(f"\n{sessions} sessions × {turns} turns on {context}-token contexts, {one_offs} one-off prompts of "
          f"{context} tokens between turns; device pool: one context; tier: {tier_contexts:g} contexts\n")
    print("| gate | prompt tokens | recomputed | restored from the tier | blocks stored |")
    print("|---|---:|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random_llama(Path(tmp) / "tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128, vocab_size=vocab,
                                 max_position_embeddings=4 * context)
        blocks = (context + 8 * turns + 16) // block + 2
        for min_uses in (1, 2):
            rng = random.Random(1)
            probe = LLM(str(path), device="cpu", num_gpu_blocks_override=blocks, block_size=block, max_num_seqs=1)
            tier_gib = tier_contexts * (context // block) * (probe.engine.runner.kv_cache_bytes() // blocks) / GIB
            probe.engine.shutdown()
            llm = LLM(str(path), device="cpu", num_gpu_blocks_override=blocks, block_size=block, max_num_seqs=1,
                      kv_offloading_size=tier_gib)
            llm.engine.kv.offload.gate = ReuseGate(min_uses)
            history = [_prompt(rng, context, vocab) for _ in range(sessions)]
            total = recomputed = 0
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            for _ in range(turns):
                for s in range(sessions):
                    out = llm.generate([history[s] + [7]], params, use_tqdm=False)[0]
                    total += len(history[s]) + 1
                    recomputed += len(history[s]) + 1 - out.num_cached_tokens
                    history[s] = history[s] + [7] + list(out.outputs[0].token_ids)
                    for _ in range(one_offs):
                        llm.generate([_prompt(rng, context, vocab)], params, use_tqdm=False)
            stats = llm.engine.kv.offload.snapshot_stats()
            name = "store everything (min_uses 1)" if min_uses == 1 else "second use (min_uses 2)"
            print(f"| {name} | {total:,} | {recomputed:,} | {stats.hit_tokens:,} | {stats.blocks_stored:,} |",
                  flush=True)


def sleep_section(model: str | None, device: str) -> None:
    from engine import LLM, SamplingParams
    from engine.bench.random_model import make_random_llama
    from engine.planning.units import GIB
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = model or make_random_llama(Path(tmp) / "llama")
        start = time.perf_counter()
        llm = LLM(str(path), device=device, max_num_seqs=4)
        print(f"\n{model or 'bench Llama'} on {device}: started in {time.perf_counter() - start:.1f} s\n")
        print("| level | sleep (s) | wake (s) | KV cache freed | weights freed | same greedy ids after |")
        print("|---|---:|---:|---:|---:|---|", flush=True)
        prompt = list(range(4, 68))
        before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        for level in (1, 2):
            t0 = time.perf_counter()
            freed = llm.sleep(level)
            t1 = time.perf_counter()
            llm.wake_up()
            t2 = time.perf_counter()
            after = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            print(f"| {level} | {t1 - t0:.2f} | {t2 - t1:.2f} | {freed['kv_cache_bytes'] / GIB:.2f} GiB | "
                  f"{freed['weights_bytes'] / GIB:.2f} GiB | {'yes' if after == before else 'NO'} |", flush=True)
        llm.engine.shutdown()


def planner_section() -> None:
    from engine.bench.families import AWQ_G128 as GEMMA_AWQ, GEMMA3_27B_IT
    from engine.bench.hybrid import AWQ_G128 as QWEN_AWQ, QWEN3_6_27B, QWEN3_6_35B_A3B
    from engine.bench.moe_configs import GPT_OSS_20B
    from engine.config.model import ModelConfig
    from engine.planning.offload import plan_host_tier
    from engine.planning.planner import plan_capacity
    from engine.planning.units import GIB
    cases = [("Qwen3.6-27B AWQ", {**QWEN3_6_27B, "quantization_config": QWEN_AWQ}),
             ("Qwen3.6-35B-A3B AWQ", {**QWEN3_6_35B_A3B, "quantization_config": QWEN_AWQ}),
             ("Gemma-3-27B-it AWQ", {**GEMMA3_27B_IT, "quantization_config": GEMMA_AWQ}),
             ("gpt-oss-20b (MXFP4)", GPT_OSS_20B)]
    print(f"\ncontext that fits at --gpu-memory-utilization 0.9, max_num_seqs 4, CUDA graphs; the model's own "
          f"max_model_len; a {TIER_GIB:g} GiB CPU-RAM tier's extra tokens\n")
    print("| model | cards | KV dtype | KV/token/card | KV tokens on the cards | + tokens in a 64 GiB tier |")
    print("|---|---|---|---:|---:|---:|")
    for name, hf in cases:
        cfg = ModelConfig.from_hf_config(hf)
        for tp in (1, 2):
            for kv in KV_DTYPES:
                p = plan_capacity(cfg, [24 * GIB] * tp, 0.9, dtype="bfloat16", kv_cache_dtype=kv,
                                  tensor_parallel_size=tp, max_num_seqs=4, cuda_graphs=True)
                host = plan_host_tier(p.layout, TIER_GIB, tp)
                label = "bf16" if kv == "auto" else kv
                print(f"| {name} | {tp} × 24 GiB | {label} | {p.kv_bytes_per_token / 1024:.1f} KiB | "
                      f"{p.num_tokens:,} | {host.num_tokens(16):,} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench offload", description=__doc__.split("\n")[0])
    parser.add_argument("--section", choices=("tier", "gate", "planner", "sleep"), action="append",
                        help="what to run (repeatable; default: all)")
    parser.add_argument("--context", type=int, default=4096, help="tier: the shared context's tokens")
    parser.add_argument("--question", type=int, default=32, help="tier: tokens a turn adds")
    parser.add_argument("--model", help="tier, sleep: a model folder to serve instead of the bench Llama")
    parser.add_argument("--device", default="cpu", help="tier, sleep: cpu or cuda")
    parser.add_argument("--kv-cache-dtype", default="auto", help="tier: the KV cache's dtype")
    parser.add_argument("--sessions", type=int, default=2, help="gate: sessions")
    parser.add_argument("--turns", type=int, default=4, help="gate: turns per session")
    parser.add_argument("--gate-context", type=int, default=256, help="gate: a session's context tokens")
    parser.add_argument("--one-offs", type=int, default=2, help="gate: one-off prompts after each turn")
    parser.add_argument("--tier-contexts", type=float, action="append",
                        help="gate: the tier's size in contexts (repeatable; default 1.5 and 8)")
    args = parser.parse_args(argv)
    sections = args.section or ["planner", "gate", "tier", "sleep"]
    if "planner" in sections:
        planner_section()
    if "gate" in sections:
        for tier_contexts in args.tier_contexts or [1.5, 8.0]:
            gate_section(args.sessions, args.turns, args.gate_context, args.one_offs, tier_contexts)
    if "tier" in sections:
        tier_section(args.context, args.question, args.model, args.device, args.kv_cache_dtype)
    if "sleep" in sections:
        sleep_section(args.model, args.device)


if __name__ == "__main__":
    main()
