"""`pagedesk-bench itl`: inter-token latency of running streams while prompts arrive, per step budget.

Replays one Poisson arrival trace (10% long prompts by default) through the real engine in-process on a
simulated clock that advances by each step's measured CPU time (`time.process_time`; one thread by
default, so the clock counts work and not threads spinning while others are descheduled), so the figures
say what a step budget does to ITL without the noise of other programs on a shared machine (wall-clock
figures come from `pagedesk-bench serve` against a server). On a GPU (`--device cuda --model FOLDER`) CPU
time misses the card's work, so the clock is elapsed time there. A stream's ITL is the clock
between its successive tokens; TTFT runs from its arrival. The maximum request rate is measured first
(everything arriving at once); the trace then runs at `--load` × that rate for each configuration.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.bench.random_model import make_random_llama
from engine.bench.serve_dataset import synthetic_requests
from engine.bench.serve_load import arrival_times


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def replay(path: Path, requests, offsets: np.ndarray, max_model_len: int, device: str = "cpu",
           clock_name: str = "cpu", **engine_kwargs) -> dict:
    """Run the trace; return per-stream ITLs and TTFTs (seconds of the chosen clock: engine CPU time, or wall
    time for a GPU, whose work CPU time does not see; a step ends with its sampled ids on the host, so
    its GPU work is done) and the makespan."""
    from engine import SamplingParams
    from engine.config.flags import EngineConfig
    from engine.entrypoints.llm_engine import LLMEngine

    now = CLOCKS[clock_name]
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(path), device=device, max_model_len=max_model_len,
                                                **engine_kwargs))
    clock, sent, last, itls, ttfts = 0.0, 0, {}, [], []
    while sent < len(requests) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and offsets[sent] > clock:
            clock = float(offsets[sent])  # idle until the next arrival
        while sent < len(requests) and offsets[sent] <= clock:
            r = requests[sent]
            engine.add_request(str(sent), r.prompt, SamplingParams(temperature=0, max_tokens=r.output_len,
                                                                   ignore_eos=True))
            sent += 1
        start = now()
        outputs = engine.step()
        clock += now() - start
        for out in outputs:
            n = len(out.outputs[0].token_ids)
            if n == 1:
                ttfts.append(clock - offsets[int(out.request_id)])
            elif n > 1 and out.request_id in last:
                itls.append(clock - last[out.request_id])
            last[out.request_id] = clock
    engine.shutdown()
    return {"itl": np.array(itls), "ttft": np.array(ttfts), "makespan": clock}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pagedesk-bench itl", description=__doc__)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--long-prompt-fraction", type=float, default=0.1)
    p.add_argument("--load", type=float, default=0.7, help="share of the measured maximum request rate")
    p.add_argument("--budgets", default="off,2048,256,64,2048/64,2048/32",
                   help="step budgets to compare: B (tokens per step), B/P (and at most P prompt tokens in a "
                   "step that decodes: --max-batch-prefill-tokens), off (chunked prefill off)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch and numba threads (1: the CPU-time clock then "
                   "counts work only; with more, a thread spinning at a barrier while its peer is descheduled "
                   "by other programs is counted too)")
    p.add_argument("--model", type=Path, help="a model folder (default: the random benchmark Llama); on a GPU "
                   "use a real-sized one, a tiny model's steps cost only kernel launches")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--clock", choices=tuple(CLOCKS), help="cpu: engine CPU time (default on CPU); wall: "
                   "elapsed time (default on CUDA; use a machine with nothing else running)")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    try:
        import numba
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass  # a GPU machine without numba: the CPU decode kernel is not used there
    clock = args.clock or ("wall" if args.device == "cuda" else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_random_llama(Path(tmp) / "bench-llama")
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        requests = synthetic_requests(args.num_prompts, vocab, args.max_model_len, args.seed,
                                      long_fraction=args.long_prompt_fraction, long_range=(1024, 1900),
                                      fixed_output_len=args.output_len)
        run = dict(max_model_len=args.max_model_len, device=args.device, clock_name=clock)
        burst = replay(path, requests, np.zeros(len(requests)), **run)
        max_rate = len(requests) / burst["makespan"]
        rate = args.load * max_rate
        offsets = arrival_times(len(requests), rate, args.seed)
        print(f"\n{args.device}, {clock} clock, {args.threads} thread(s); {len(requests)} requests ({args.long_prompt_fraction:.0%} with "
              f"1024-1900-token prompts), {args.output_len} output tokens; max rate {max_rate:.3f} req/s of "
              f"{clock} time; trace at {rate:.3f} req/s ({args.load:.0%})\n")
        print("| chunked prefill, step budget / prompt-token cap | ITL p50 ms | ITL p90 ms | ITL p99 ms "
              "| ITL p99 / p50 | TTFT p50 ms | TTFT p99 ms | makespan s |\n|---|---:|---:|---:|---:|---:|---:|---:|")
        for budget in args.budgets.split(","):
            tokens, _, cap = budget.partition("/")
            kwargs = ({"enable_chunked_prefill": False} if budget == "off" else
                      {"max_num_batched_tokens": int(tokens), "max_batch_prefill_tokens": int(cap or 0)})
            r = replay(path, requests, offsets, **run, **kwargs)
            i50, i90, i99 = np.percentile(r["itl"], (50, 90, 99)) * 1e3
            t50, t99 = np.percentile(r["ttft"], (50, 99)) * 1e3
            label = "off (whole prompts)" if budget == "off" else f"on, {budget}"
            print(f"| {label} | {i50:.0f} | {i90:.0f} | {i99:.0f} | {i99 / i50:.1f}× | {t50:.0f} | {t99:.0f} | "
                  f"{r['makespan']:.1f} |", flush=True)
