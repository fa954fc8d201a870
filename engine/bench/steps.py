"""`pagedesk-bench steps`: the engine's host time per decode step, outside the forward, at batch 1, 8 and 64.

B requests decode together on the CPU (greedy, EOS ignored) and each step is timed whole and inside the model
runner's `run` (the forward, its logits and the sampling kernel); the difference is what the Python around the
model costs per step (schedule, plan, prepare, process, detokenize, outputs). Where the tree has the engine's
step timer (engine/core/step_timer.py) the table splits that time by phase. The same file measures an older
tree too (`PYTHONPATH=<old tree> python engine/bench/steps.py`), so before and after come from one command.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

HOST_PHASES = ("schedule", "plan", "prepare", "process", "outputs")


def time_steps(engine, num_steps: int) -> tuple[list[float], list[float], list[dict]]:
    """Per step: its seconds, the seconds inside `runner.run`, and the step timer's laps (if the tree has one)."""
    runner, inside = engine.runner, [0.0]
    run = runner.run

    def timed_run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start

    runner.run = timed_run
    totals, forwards, laps = [], [], []
    timer = getattr(engine, "timer", None)
    try:
        for _ in range(num_steps):
            inside[0] = 0.0
            start = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - start)
            forwards.append(inside[0])
            if timer is not None:
                laps.append(dict(timer.laps))
    finally:
        del runner.run  # the instance attribute goes; the class's method is back
    return totals, forwards, laps


def measure(engine, batch: int, num_steps: int, warm_up: int, prompt_len: int, vocab: int) -> dict:
    """Medians over `num_steps` decode steps of `batch` sequences (after `warm_up` steps: prompts, caches)."""
    from engine.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=warm_up + num_steps + 8, ignore_eos=True)
    ids = [f"steps-{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [4 + (i * 131 + j * 17) % (vocab - 4) for j in range(prompt_len)], params)
    for _ in range(warm_up):
        engine.step()
    totals, forwards, laps = time_steps(engine, num_steps)
    for request_id in ids:
        engine.abort_request(request_id)
    row = {"step": statistics.median(totals), "forward": statistics.median(forwards),
           "outside": statistics.median(t - f for t, f in zip(totals, forwards)),
           "outside_best": min(t - f for t, f in zip(totals, forwards))}
    for phase in HOST_PHASES if laps else ():
        row[phase] = statistics.median(lap[phase] for lap in laps)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench steps", description=__doc__)
    parser.add_argument("--model", type=Path, help="model folder (default: the peer bench's 2-layer random Llama)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warm-up", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--async-scheduling", action="store_true", help="the engine's --async-scheduling")
    parser.add_argument("--compile-cpu-forward", action="store_true",
                        help="the engine's --compile-cpu-forward (compiled during the warm-up steps)")
    args = parser.parse_args(argv)
    import torch

    from engine import LLM

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:  # an older tree has no PEER_LLAMA: it is given --model (BENCHMARKS.md)
            from engine.bench.random_model import PEER_LLAMA, make_random_llama
        path = args.model or make_random_llama(Path(tmp) / "peer-llama", **PEER_LLAMA)
        extra = {name: True for name in ("async_scheduling", "compile_cpu_forward") if getattr(args, name)}
        llm = LLM(str(path), device="cpu", max_model_len=args.prompt_len + args.warm_up + args.steps + 64,
                  max_num_seqs=max(args.batch), **extra)
        vocab = llm.engine.model_config.vocab_size
        rows = [(b, measure(llm.engine, b, args.steps, args.warm_up, args.prompt_len, vocab)) for b in args.batch]
    phases = [p for p in HOST_PHASES if p in rows[0][1]]
    print(f"\n{path.name}: {args.steps} decode steps per batch size after {args.warm_up} warm-up steps, "
          f"{args.prompt_len}-token prompts{''.join(', ' + k.replace('_', ' ') for k in extra)}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}\n")
    print("| batch | step ms | forward ms | outside the forward ms (best) |" + "".join(f" {p} ms |" for p in phases))
    print("|---:|---:|---:|---:|" + "---:|" * len(phases))
    for batch, row in rows:
        cells = "".join(f" {1e3 * row[p]:.3f} |" for p in phases)
        print(f"| {batch} | {1e3 * row['step']:.2f} | {1e3 * row['forward']:.2f} | {1e3 * row['outside']:.3f} "
              f"({1e3 * row['outside_best']:.3f}) |" + cells)


if __name__ == "__main__":
    main()
