"""Drive an OpenAI-compatible endpoint with a request schedule and collect timed outcomes (torch-free).

Arrivals follow a Poisson process at `request_rate` (exponential gaps from a seeded numpy generator;
`inf` sends everything at once), and at most `max_concurrency` requests are in flight (a semaphore, as
`vllm bench serve --max-concurrency`). Used by the `pagedesk-bench serve` CLI and the app's Benchmark tab;
`on_outcome` is called for each finished request so a caller can draw progress live.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Callable

import httpx
import numpy as np

from engine.bench.serve_client import RequestOutcome, request_body, send_request
from engine.bench.serve_dataset import ServeRequest
from engine.bench.serve_metrics import ServeSummary, summarize

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class ServeLoad:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without a trailing /v1)
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "completions"  # completions | chat
    request_rate: float = math.inf  # requests / s, Poisson
    max_concurrency: int | None = None
    ignore_eos: bool = True
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {list(ENDPOINT_PATHS)}, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 requests/s (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


def arrival_times(num: int, rate: float, seed: int) -> np.ndarray:
    """Send offsets in seconds from the start: cumulative exponential gaps (a Poisson process), scaled so the
    last request goes at (num - 1) / rate. Unscaled, a draw of 80 gaps offers anywhere from ~0.8x to ~1.2x
    the rate asked for, and runs at "the same rate" load the server differently (vllm bench serve scales
    its draws the same way)."""
    if math.isinf(rate):
        return np.zeros(num)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num)
    gaps[0] = 0.0  # the first request goes at once
    offsets = np.cumsum(gaps)
    if num > 1:
        offsets *= (num - 1) / rate / offsets[-1]
    return offsets


async def first_model(client: httpx.AsyncClient, root: str) -> str:
    response = await client.get(root + "/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{root}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def run_load(load: ServeLoad, requests: list[ServeRequest],
                   on_outcome: Callable[[RequestOutcome], None] | None = None,
                   stop: Callable[[], bool] | None = None) -> tuple[list[RequestOutcome], float]:
    """Send every request on schedule; return the outcomes (request order) and the wall time.

    `stop()` returning True ends the schedule early: requests not yet sent are left out."""
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(load.timeout_s, connect=10.0)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = load.model or await first_model(client, load.root)
        url = load.root + ENDPOINT_PATHS[load.endpoint]
        bodies = [request_body(r, model, load.endpoint, load.ignore_eos) for r in requests]
        gate = asyncio.Semaphore(load.max_concurrency or len(requests) or 1)
        offsets = arrival_times(len(requests), load.request_rate, load.seed)
        start = time.perf_counter()

        async def one(i: int) -> RequestOutcome | None:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            async with gate:
                if stop is not None and stop():
                    return None
                outcome = RequestOutcome(requests[i].prompt_len, requests[i].output_len)
                await send_request(client, url, bodies[i], load.endpoint, outcome)
            if on_outcome is not None:
                on_outcome(outcome)
            return outcome

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration


def run_benchmark(load: ServeLoad, requests: list[ServeRequest], slo_ttft_ms: float | None = None,
                  slo_itl_ms: float | None = None, on_outcome=None, stop=None) -> ServeSummary:
    outcomes, duration = asyncio.run(run_load(load, requests, on_outcome, stop))
    return summarize(outcomes, duration, slo_ttft_ms, slo_itl_ms)
