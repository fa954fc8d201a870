"""`pagedesk-bench threads`: decode throughput at 1, 8 and 64 streams, on a quiet machine and beside a CPU hog the
bench starts, with the engine's thread budget (engine/platform/threads.py) and with every pool at its library
default (`PAGEDESK_THREAD_BUDGET=0`), so a collapse under oversubscription shows as a column falling off.

Each configuration runs in a fresh process (OpenMP reads its wait policy once, when torch loads) on the peer
bench's 2-layer random Llama: S requests decode T tokens each (greedy, EOS ignored) and the table gives their
output tokens per second. The hog is `--hog` processes (default: one per core) spinning in Python.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {"thread budget": {}, "library defaults": {"PAGEDESK_THREAD_BUDGET": "0"}}


def spin(stop) -> None:  # pragma: no cover - a hog process
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


PROMPT_LEN = 16


def measure(model: Path, streams: list[int], tokens: int) -> dict[int, float]:
    """Output tokens per second of `s` concurrent requests, for each s (in this process)."""
    from engine import LLM, SamplingParams

    llm = LLM(str(model), device="cpu", max_model_len=PROMPT_LEN + tokens + 8, max_num_seqs=max(streams))
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([[4, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    rates = {}
    for s in streams:
        prompts = [[4 + (i * 31 + j) % (vocab - 4) for j in range(PROMPT_LEN)] for i in range(s)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates[s] = s * tokens / (time.perf_counter() - start)
    return rates


def run_config(env: dict[str, str], model: Path, streams: list[int], tokens: int) -> dict[int, float]:
    child = [sys.executable, "-m", "engine.bench.threads", "--child", str(model), "--tokens", str(tokens),
             "--streams", *map(str, streams)]
    done = subprocess.run(child, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the measuring process failed ({env or 'thread budget'}):\n{done.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench threads", description=__doc__)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, default=64, help="tokens each stream decodes")
    parser.add_argument("--hog", type=int, default=os.cpu_count(), help="spinning processes beside the engine")
    parser.add_argument("--model", type=Path, help="model folder (default: the peer bench's 2-layer random Llama)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.child, args.streams, args.tokens)))
        return
    from engine.bench.random_model import PEER_LLAMA, make_random_llama

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_random_llama(Path(tmp) / "peer-llama", **PEER_LLAMA)
        for name, env in CONFIGS.items():
            results[name, "quiet"] = run_config(env, model, args.streams, args.tokens)
        stop = multiprocessing.Event()
        hogs = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.hog)]
        for hog in hogs:
            hog.start()
        try:
            for name, env in CONFIGS.items():
                results[name, "hog"] = run_config(env, model, args.streams, args.tokens)
        finally:
            stop.set()
            for hog in hogs:
                hog.join(5)
    columns = [(name, load) for load in ("quiet", "hog") for name in CONFIGS]
    print(f"\n{model.name}: {args.tokens} tokens per stream, greedy; {os.cpu_count()} cores, a hog of {args.hog} "
          f"spinning processes\n")
    print("| streams | " + " | ".join(f"{name}, {'quiet' if load == 'quiet' else 'beside the hog'} tok/s"
                                    for name, load in columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for s in args.streams:
        print(f"| {s} | " + " | ".join(f"{results[c][s]:.1f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
