"""CPU float32 linears of a decode step: `F.linear` (torch's BLAS) against the row kernels (kernels/cpu_linear.py:
numba's and the native build, when this machine has a C compiler),
over every matrix of a Llama-shaped model once per pass, as a decode step reads them; prints a markdown table
(`python -m kernels.bench_cpu_linear [--hidden 512 --layers 2]`). The model's matrices are kept in several copies
whose total exceeds the L3 cache, cycled, so each pass reads its weights from memory as a real step does (a
benchmark that multiplies one matrix over and over measures the cache instead). Figures go to BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kernels import cpu_linear, native_build


def model_matrices(hidden: int, layers: int, vocab: int, generator: torch.Generator) -> list[torch.Tensor]:
    """[out, in] weights of a Llama decoder (fused qkv with half as many KV heads, fused gate/up at 3x hidden)
    and its LM head."""
    inter = 3 * hidden
    shapes = [(2 * hidden, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers
    return [torch.randn(*shape, generator=generator) for shape in shapes + [(vocab, hidden)]]


def pass_ms(linear, copies: list[list[torch.Tensor]], rows: int, repeats: int) -> float:
    """Median milliseconds of one pass over a model's matrices, cycling through the copies."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in copies[0]}
    times = []
    for i in range(repeats * len(copies) + len(copies)):  # the first round of copies warms up
        start = time.perf_counter()
        for w in copies[i % len(copies)]:
            linear(inputs[w.shape[1]], w)
        if i >= len(copies):
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench_cpu_linear", description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    parser.add_argument("--cache-mib", type=int, default=32, help="the L3 size to exceed (copies are made)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    one = model_matrices(args.hidden, args.layers, args.vocab, generator)
    model_mb = sum(w.numel() * 4 for w in one) / 2**20
    copies = [one] + [[w.clone() for w in one] for _ in range(int(2 * args.cache_mib // model_mb))]
    kernels = {"numba": None, "rows": None}
    for name in kernels:
        cpu_linear.set_backend(name)
        cpu_linear.warm_up()
        kernels[name] = cpu_linear.implementation()
    columns = ["numba"] + (["native"] if kernels["rows"] == "native" else [])
    print(f"\nLlama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {model_mb:.0f} MiB of float32 "
          f"weights per pass, {len(copies)} copies cycled; torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads" + ("" if "native" in columns else f"; no native build ({native_build.why_not})") + "\n")
    print("| rows | F.linear ms |" + "".join(f" {c} ms |" for c in columns)
          + "".join(f" F.linear / {c} |" for c in columns))
    print("|---:|---:|" + "---:|" * 2 * len(columns))
    backends = {"numba": "numba", "native": "rows"}
    for rows in args.rows:
        torch_ms = pass_ms(F.linear, copies, rows, args.repeats)
        ms = []
        for column in columns:
            cpu_linear.set_backend(backends[column])
            ms.append(pass_ms(cpu_linear.linear, copies, rows, args.repeats))
        print(f"| {rows} | {torch_ms:.2f} |" + "".join(f" {m:.2f} |" for m in ms)
              + "".join(f" {torch_ms / m:.2f}x |" for m in ms), flush=True)


if __name__ == "__main__":
    main()
