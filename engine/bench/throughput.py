"""`pagedesk-bench throughput`: output tokens/s of our engine vs HF `generate` (static padded batches) and
HF continuous batching (`generate_batch`'s manager), on the same random-weight model and workload.

Every system generates exactly each request's drawn length (EOS ignored), so output tokens are equal and
the ratio of tokens/s is the ratio of wall time.
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from statistics import median

import torch

from engine.bench.random_model import make_random_llama
from engine.bench.workload import BenchRequest, sharegpt_like


def run_engine(path: Path, requests: list[BenchRequest], max_model_len: int,
               **engine_kwargs) -> tuple[float, dict[int, list[float]]]:
    """Wall time, and per batch size the engine's overhead share of each step: everything but `runner.run`
    (block copies, model, logits and the on-device sampling kernel) — scheduling, input preparation,
    per-step sampling tensors, appending tokens, detokenizing, stop checks and outputs."""
    from engine import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", max_model_len=max_model_len, **engine_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    # One short request first: the attention kernels' compiled code loads and the first forwards' allocations are
    # made outside the timed run (HF's generate has no such first-call cost).
    llm.generate([requests[0].prompt_token_ids], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    overhead = _profile_steps(llm.engine)
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in requests]
    return elapsed, overhead


def _profile_steps(engine) -> dict[int, list[float]]:
    """Wrap the engine's step and its runner's forward with timers (instance attributes; nothing else changes)."""
    shares: dict[int, list[float]] = defaultdict(list)
    forward = [0.0]
    run, step = engine.runner.run, engine.step

    def timed_run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            forward[0] += time.perf_counter() - t

    def timed_step():
        forward[0] = 0.0
        batch = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        t = time.perf_counter()
        result = step()
        total = time.perf_counter() - t
        shares[batch].append((total - forward[0]) / total)
        return result

    engine.runner.run, engine.step = timed_run, timed_step
    return shares


def overhead_line(shares: dict[int, list[float]], batch: int) -> str:
    """Median overhead share over steps that started with `batch` (or more) sequences, and over all steps."""
    at_batch = [x for size, xs in shares.items() if size >= batch for x in xs]
    everything = [x for xs in shares.values() for x in xs]
    return (f"engine overhead (step time outside the forward): median {100 * median(at_batch):.1f}% over "
            f"{len(at_batch)} steps with {batch} sequences, {100 * median(everything):.1f}% over all "
            f"{len(everything)} steps")


def run_hf_static(path: Path, requests: list[BenchRequest], batch_size: int) -> float:
    """HF generate in arrival order, left-padded batches; each batch runs to its longest output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        longest = max(r.output_len for r in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start


def run_hf_continuous(path: Path, requests: list[BenchRequest]) -> float:
    """HF transformers' own continuous batching (the manager behind `generate_batch`), per-request lengths."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(r.output_len for r in requests))
    # Its cache sized for the workload, as ours is: left to itself on a CPU it sizes a cache from the host's free
    # memory and warms up at that size (tens of seconds on two cores, before the first token).
    page = 256
    blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page) for r in requests)
    cache = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=2048)
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=30,
                                                   continuous_batching_config=cache) as manager:
        start = time.perf_counter()  # set-up and warm-up done, as our engine's start is outside its time
        for i, r in enumerate(requests):
            manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len, eos_token_id=-1)
        done = 0
        while done < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing")
        elapsed = time.perf_counter() - start  # the last result is in: the manager's shutdown is not generation
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench throughput", description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--model", type=Path, help="model folder (default: random Llama made on the fly)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="time only our engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-mean", type=float, default=160, help="mean prompt tokens (log-normal draws)")
    parser.add_argument("--output-mean", type=float, default=300, help="mean output tokens (log-normal draws)")
    parser.add_argument("--reference-attention", action="store_true",
                        help="CPU attention by the torch oracle (gather + SDPA) instead of the numba kernel")
    args = parser.parse_args(argv)
    if args.reference_attention:
        import kernels.attention_cpu
        from kernels.attention_torch import paged_attention_torch
        kernels.attention_cpu.paged_attention_cpu = paged_attention_torch  # looked up when the model is built
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_random_llama(Path(tmp) / "bench-llama")
        from transformers import AutoConfig
        vocab = AutoConfig.from_pretrained(path).vocab_size
        requests = sharegpt_like(args.num_prompts, vocab, args.max_model_len, args.seed, args.prompt_mean,
                                 args.output_mean)
        out_tokens = sum(r.output_len for r in requests)
        elapsed, overhead = run_engine(path, requests, args.max_model_len)
        rows = [("pagedesk (paged, continuous)", elapsed)]
        if not args.skip_hf:
            rows.append((f"HF generate, static batches of {args.hf_batch_size}",
                         run_hf_static(path, requests, args.hf_batch_size)))
            rows.append(("HF continuous batching (generate_batch)", run_hf_continuous(path, requests)))
    ours = out_tokens / rows[0][1]
    print(f"\n{args.num_prompts} requests, {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{out_tokens} output tokens; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}\n")
    print("| system | seconds | output tok/s | pagedesk speed-up |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows:
        tps = out_tokens / seconds
        print(f"| {name} | {seconds:.1f} | {tps:.1f} | {ours / tps:.2f}× |")
    print("\n" + overhead_line(overhead, args.num_prompts))
