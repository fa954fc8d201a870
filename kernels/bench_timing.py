"""Timing and reporting helpers shared by the kernel benchmarks (kernels/bench.py, kernels/bench_models.py).

CUDA-event medians after warm-up, the number of input copies needed to defeat the L2 cache, a measured
device-to-device copy bandwidth as the practical ceiling, and markdown tables. Wall-clock timing stands
in on CPU so smoke runs exercise the same code.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

SPIN_CYCLES = 1_000_000  # ~0.5 ms at ~2 GHz: longer than Python takes to enqueue any one timed call


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 << 20
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) or (64 << 20)


def rotations_for(bytes_per_call: float, l2: int, limit: int = 64) -> int:
    """How many input copies one must cycle through so that each call finds its inputs out of L2."""
    return max(1, min(limit, math.ceil(3 * l2 / max(bytes_per_call, 1))))


def median_ms(fn: Callable[[int], object], rotations: int, device: torch.device, iters: int = 50,
              keep_gpu_busy: bool = True) -> float:
    """Median time of `fn(i % rotations)`: CUDA events on a GPU, wall clock elsewhere (smoke runs).

    With `keep_gpu_busy` a spin kernel is queued before each timed call, so the GPU is still busy while
    Python enqueues the call and the events time the kernels, not the launch overhead; leave it off to
    time what a caller waits for (eager model steps).
    """
    for i in range(max(1, min(10, iters // 5))):
        fn(i % rotations)
    if device.type != "cuda":
        samples = []
        for i in range(iters):
            start = time.perf_counter()
            fn(i % rotations)
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (start, end) in enumerate(events):
        if keep_gpu_busy:
            torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn(i % rotations)
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth(device: torch.device, size: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), the practical bandwidth ceiling."""
    src = torch.empty(size, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda _: dst.copy_(src), 1, device, iters=20)
    return 2 * size / (ms * 1e-3)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
