"""Durations as a person reads them: milliseconds below a second ("142 ms", "3.5 ms"), seconds from there on
("12.3 s", not "12,300 ms"), minutes past two of them. The chat's TTFT and the Benchmark's latencies use it."""
from __future__ import annotations

import math


def format_ms(ms: float) -> str:
    if ms is None or math.isnan(ms):
        return "–"
    if ms < 10:
        return f"{ms:.1f} ms"
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 120_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"
