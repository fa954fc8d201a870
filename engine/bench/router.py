"""`pagedesk-bench router`: what the router costs, and what data parallel buys, on real processes.

`overhead`: one engine served directly (`pagedesk-serve --model FOLDER`) and the same model through the
router (`--model m=FOLDER --model-ttl` makes it the router, with one engine of the same flags behind it), each
process tree pinned to the same single core with one thread (so the router's own CPU time is paid on the
engine's core, as on a CPU-bound box); the same streaming load at `--streams` concurrent requests against
each, alternating `--repeats` times, and the ITL/TPOT percentiles side by side. `dp`: the router with `--data-parallel-size 1` (the whole process tree pinned to one
core with `taskset`, one thread) against `--data-parallel-size 2` (the router pins each replica to its own
core), output throughput at `--streams` concurrency: two CPU cores standing in for two cards. The model is a
random-weight llama written to a temporary folder unless `--model` names one. Prints markdown tables.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.bench.serve_dataset import synthetic_requests
from engine.bench.serve_load import ServeLoad, run_benchmark

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], port: int, pin: str | None = None, threads: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    prefix = ["taskset", "-c", pin] if pin else []
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "engine.entrypoints.serve", *argv, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{argv} exited with {proc.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{argv} did not come up")


def load_all(port: int, names: list[str]) -> None:
    for name in names:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/models/{name}/load", timeout=600)
        r.raise_for_status()


def measure(port: int, model: str, args, seed: int = 0):
    requests = synthetic_requests(args.num_prompts, 8192, 1024, seed, args.prompt_len, args.output_len,
                                  fixed_output_len=args.output_len)
    load = ServeLoad(f"http://127.0.0.1:{port}", model, max_concurrency=args.streams, seed=seed)
    run_benchmark(load, requests[: args.streams])  # warm: first requests compile and fill caches
    return run_benchmark(load, requests)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def overhead(folder: Path, args) -> None:
    flags = ["--device", "cpu", "--max-model-len", "1024", *args.engine_flags]
    direct_port, router_port = free_port(), free_port()
    core = str(sorted(os.sched_getaffinity(0))[0])  # both on one core, one thread: the router's CPU counts
    direct = start(["--model", str(folder), "--served-model-name", "m", *flags], direct_port, pin=core, threads=1)
    router = start(["--model", f"m={folder}", "--model-ttl", "100000", *flags], router_port, pin=core, threads=1)
    try:
        load_all(router_port, ["m"])
        rows = []
        for _ in range(args.repeats):  # alternate, so drift on a shared machine hits both alike
            rows.append(("direct", measure(direct_port, "m", args)))
            rows.append(("router", measure(router_port, "m", args)))
    finally:
        stop(router)
        stop(direct)
    print(f"\n{args.streams} concurrent streams, {args.num_prompts} requests of {args.prompt_len} prompt / "
          f"{args.output_len} output tokens\n")
    print("| path | ITL p50 ms | ITL p99 ms | TPOT p50 ms | TTFT p50 ms | output tok/s | errors |")
    print("|---|---|---|---|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s.itl.p50_ms:.1f} | {s.itl.p99_ms:.1f} | {s.tpot.p50_ms:.1f} | {s.ttft.p50_ms:.1f} | "
              f"{s.output_throughput:.1f} | {s.errors} |")


def data_parallel(folder: Path, args) -> None:
    flags = ["--device", "cpu", "--max-model-len", "1024", *args.engine_flags]
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    for dp in (1, 2):
        port = free_port()
        argv = ["--model", f"m={folder}", "--data-parallel-size", str(dp), "--model-ttl", "100000", *flags]
        proc = start(argv, port, pin=str(cores[0]) if dp == 1 else None, threads=1 if dp == 1 else None)
        try:
            load_all(port, ["m"])
            rows.append((dp, measure(port, "m", args)))
        finally:
            stop(proc)
    print(f"\n{args.streams} concurrent streams, {args.num_prompts} requests of {args.prompt_len} prompt / "
          f"{args.output_len} output tokens; replicas pinned one core each\n")
    print("| replicas | output tok/s | request/s | TPOT p50 ms | errors |")
    print("|---|---|---|---|---|")
    for dp, s in rows:
        print(f"| {dp} | {s.output_throughput:.1f} | {s.request_throughput:.2f} | {s.tpot.p50_ms:.1f} | {s.errors} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pagedesk-bench router", description=__doc__)
    p.add_argument("what", choices=("overhead", "dp"))
    p.add_argument("--model", type=Path, help="model folder (default: a random-weight llama)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--engine-flags", nargs=argparse.REMAINDER, default=[], help="passed to every engine")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if folder is None:
            from engine.bench.random_model import make_random_llama
            folder = make_random_llama(Path(tmp) / "llama", hidden_size=256, num_hidden_layers=4,
                                       intermediate_size=768)
        (overhead if args.what == "overhead" else data_parallel)(folder, args)
