"""Serving metrics from timed requests: latency percentiles, throughput and goodput (numpy; torch-free).

Definitions (those of `vllm bench serve`): TTFT per request; ITL pooled over every gap of every request;
TPOT per request = (E2E − TTFT) / (output tokens − 1), requests of one token left out; E2E from send to
last byte. Throughputs divide by the benchmark's wall time (first send to last finish). A request counts
towards goodput when its TTFT ≤ the TTFT SLO and its TPOT (its mean ITL) ≤ the ITL SLO.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from engine.bench.serve_client import RequestOutcome

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Distribution:
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    count: int

    @classmethod
    def of(cls, seconds) -> "Distribution":
        values = np.asarray(seconds, dtype=np.float64) * 1e3
        if values.size == 0:
            return cls(float("nan"), float("nan"), float("nan"), float("nan"), 0)
        p50, p90, p99 = np.percentile(values, PERCENTILES)
        return cls(float(values.mean()), float(p50), float(p90), float(p99), int(values.size))


@dataclass(frozen=True, slots=True)
class ServeSummary:
    completed: int
    errors: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    goodput: float | None  # requests / s within the SLOs (None without SLOs)
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    first_errors: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(outcomes: list[RequestOutcome], duration_s: float, slo_ttft_ms: float | None = None,
              slo_itl_ms: float | None = None) -> ServeSummary:
    assert duration_s > 0, duration_s
    ok = [o for o in outcomes if o.ok]
    ttft = np.array([o.ttft for o in ok], dtype=np.float64)
    tokens = np.array([o.output_tokens for o in ok], dtype=np.int64)
    e2e = np.array([o.e2e for o in ok], dtype=np.float64)
    multi = tokens > 1
    tpot = (e2e[multi] - ttft[multi]) / (tokens[multi] - 1)
    itl = np.concatenate([np.asarray(o.itls, dtype=np.float64) for o in ok]) if ok else np.empty(0)
    goodput = None
    if slo_ttft_ms is not None or slo_itl_ms is not None:
        good = np.ones(len(ok), dtype=bool)
        if slo_ttft_ms is not None:
            good &= ttft * 1e3 <= slo_ttft_ms
        if slo_itl_ms is not None:
            per_request_tpot = np.where(multi, (e2e - ttft) / np.maximum(tokens - 1, 1), 0.0)
            good &= per_request_tpot * 1e3 <= slo_itl_ms
        goodput = float(good.sum()) / duration_s
    prompt_tokens = sum(o.prompt_len for o in ok)
    output_tokens = int(tokens.sum())
    return ServeSummary(
        completed=len(ok), errors=len(outcomes) - len(ok), duration_s=duration_s, prompt_tokens=prompt_tokens,
        output_tokens=output_tokens, request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(prompt_tokens + output_tokens) / duration_s, goodput=goodput,
        ttft=Distribution.of(ttft), tpot=Distribution.of(tpot), itl=Distribution.of(itl), e2e=Distribution.of(e2e),
        first_errors=[o.error for o in outcomes if not o.ok][:5])
