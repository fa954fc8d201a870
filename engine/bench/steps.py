"""`pagedesk-bench steps`: the engine's host time per decode step, outside the forward, at batch 1, 8 and 64.

B requests decode together on the CPU (greedy, EOS ignored) and each step is timed whole and inside the model
runner's `run` (the forward, its logits and the sampling kernel); the difference is what the Python around the
model costs per step (schedule, plan, prepare, process, detokenize, outputs). Where the tree has the engine's
step timer (engine/core/step_timer.py) the table splits that time by phase. The same file measures an older
tree too (`PYTHONPATH=<old tree> python engine/bench/steps.py`), so before and after come from one command.

`--count` counts instead of timing, for a machine whose clock says nothing (a shared one: the host part's time
swings tenfold with a cold cache after the forward and other programs on the cores): per phase of a decode step,
Python function and C calls (`sys.setprofile`) and torch ops through the dispatcher (`TorchDispatchMode`), the
model's forward and logits left out. The phases are found by wrapping the engine's parts with instance attributes,
which an older tree has too.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HOST_PHASES = ("schedule", "plan", "prepare", "process", "outputs")
MODEL = "model"  # the forward and the logits: never counted
# (path from the engine, attribute, phase): the parts a decode step goes through, in order (`--count`).
COUNTED_PARTS = (
    ("scheduler", "schedule", "schedule"), ("", "_plan_sampling", "plan"),
    ("runner.input_prep", "prepare", "prepare inputs"), ("runner.input_prep", "step_tables", "block tables"),
    ("runner.sampler", "prepare", "sampling tensors"), ("runner.dispatch", "forward", "attention metadata"),
    ("runner.model", "forward", MODEL), ("runner.model", "compute_logits", MODEL),
    ("runner.sampler", "finish", "sample"), ("output", "process", "process"),
    ("scheduler", "update_from_output", "update"), ("", "_outputs", "outputs"))


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


def _part(engine, path: str):
    for name in filter(None, path.split(".")):
        engine = getattr(engine, name)
    return engine


def count_steps(engine, num_steps: int) -> dict[str, float]:
    """Per phase ("other": the step's own glue), Python calls and torch ops per step over `num_steps` steps: keys
    "<phase> calls" and "<phase> ops" (one pass counts ops, a second calls: the dispatch mode's own Python would
    be counted otherwise)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    phase, calls, ops = ["other"], {}, {}

    def wrap(obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def entered(*args, **kwargs):
            outer, phase[0] = phase[0], label
            try:
                return inner(*args, **kwargs)
            finally:
                phase[0] = outer

        setattr(obj, name, entered)

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[phase[0]] = ops.get(phase[0], 0) + 1
            return func(*args, **(kwargs or {}))

    def count_call(frame, event, arg) -> None:
        if event in ("call", "c_call") and frame.f_code.co_filename != __file__:
            calls[phase[0]] = calls.get(phase[0], 0) + 1

    for path, name, label in COUNTED_PARTS:
        wrap(_part(engine, path), name, label)
    try:
        with CountOps():
            for _ in range(num_steps):
                engine.step()
        sys.setprofile(count_call)
        for _ in range(num_steps):
            engine.step()
    finally:
        sys.setprofile(None)
        for path, name, _ in COUNTED_PARTS:
            vars(_part(engine, path)).pop(name, None)  # the instance attribute goes; the class's method is back
    labels = [label for label in dict.fromkeys(label for _, _, label in COUNTED_PARTS) if label != MODEL]
    row = {}
    for label in labels + ["other"]:
        row[f"{label} calls"], row[f"{label} ops"] = calls.get(label, 0) / num_steps, ops.get(label, 0) / num_steps
    return row


def measure(engine, batch: int, num_steps: int, warm_up: int, prompt_len: int, vocab: int,
            count: bool = False, sampled: bool = False) -> dict:
    """Medians over `num_steps` decode steps of `batch` sequences (after `warm_up` steps: prompts, caches); with
    `count`, Python calls and torch ops per step and phase instead (count_steps)."""
    from engine.sample.sampling_params import SamplingParams

    draw = dict(temperature=0.8, top_p=0.95, seed=0) if sampled else dict(temperature=0)
    params = SamplingParams(**draw, max_tokens=warm_up + 2 * num_steps + 8, ignore_eos=True)  # 2: --count
    ids = [f"steps-{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [4 + (i * 131 + j * 17) % (vocab - 4) for j in range(prompt_len)], params)
    for _ in range(warm_up):
        engine.step()
    if count:
        row = count_steps(engine, num_steps)
        for request_id in ids:
            engine.abort_request(request_id)
        return row
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
    parser.add_argument("--cpu-linear", choices=("rows", "numba", "torch"),
                        help="the engine's --cpu-linear (default: the engine's; an older tree has no such flag)")
    parser.add_argument("--sampled", action="store_true",
                        help="requests that draw (temperature 0.8, top-p 0.95, seeded) instead of greedy ones")
    parser.add_argument("--count", action="store_true",
                        help="count Python calls and torch ops per step and phase instead of timing (a noisy machine)")
    args = parser.parse_args(argv)
    import torch

    from engine import LLM

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:  # an older tree has no PEER_LLAMA: it is given --model (BENCHMARKS.md)
            from engine.bench.random_model import PEER_LLAMA, make_random_llama
        path = args.model or make_random_llama(Path(tmp) / "peer-llama", **PEER_LLAMA)
        extra = {name: True for name in ("async_scheduling", "compile_cpu_forward") if getattr(args, name)}
        if args.cpu_linear:
            extra["cpu_linear"] = args.cpu_linear
        llm = LLM(str(path), device="cpu", max_model_len=args.prompt_len + args.warm_up + 2 * args.steps + 64,
                  max_num_seqs=max(args.batch), **extra)
        vocab = llm.engine.model_config.vocab_size
        rows = [(b, measure(llm.engine, b, args.steps, args.warm_up, args.prompt_len, vocab, args.count,
                            args.sampled)) for b in args.batch]
    kind = "sampled (temperature 0.8, top-p 0.95)" if args.sampled else "greedy"
    if args.count:
        print(f"\n{path.name}: Python calls / torch ops per {kind} decode step ({args.steps} steps), outside the "
              f"model's forward and logits\n")
        print(count_table(rows))
        return
    phases = [p for p in HOST_PHASES if p in rows[0][1]]
    settings = "".join(f", {k.replace('_', ' ')}" + ("" if v is True else f" {v}") for k, v in extra.items())
    print(f"\n{path.name}: {args.steps} {kind} decode steps per batch size after {args.warm_up} warm-up steps, "
          f"{args.prompt_len}-token prompts{settings}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}\n")
    print("| batch | step ms | forward ms | outside the forward ms (best) |" + "".join(f" {p} ms |" for p in phases))
    print("|---:|---:|---:|---:|" + "---:|" * len(phases))
    for batch, row in rows:
        cells = "".join(f" {1e3 * row[p]:.3f} |" for p in phases)
        print(f"| {batch} | {1e3 * row['step']:.2f} | {1e3 * row['forward']:.2f} | {1e3 * row['outside']:.3f} "
              f"({1e3 * row['outside_best']:.3f}) |" + cells)


def count_table(rows: list[tuple[int, dict]]) -> str:
    """Per phase, `calls / ops` at each batch size, and the totals outside the model."""
    labels = [key[:-len(" calls")] for key in rows[0][1] if key.endswith(" calls")]
    lines = ["| phase |" + "".join(f" batch {b}: calls / torch ops |" for b, _ in rows), "|---|" + "---:|" * len(rows)]
    for label in labels:
        lines.append(f"| {label} |" + "".join(f" {c[label + ' calls']:.0f} / {c[label + ' ops']:.1f} |"
                                             for _, c in rows))
    totals = [(sum(v for k, v in c.items() if k.endswith(" calls")), sum(v for k, v in c.items() if k.endswith(" ops")))
              for _, c in rows]
    lines.append("| outside the model |" + "".join(f" {a:.0f} / {b:.1f} |" for a, b in totals))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
