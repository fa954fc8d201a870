"""Numbers as a person reads them: durations in milliseconds below a second ("142 ms", "3.5 ms"), seconds from
there on ("12.3 s", not "12,300 ms"), minutes past two of them; counts with their noun in the right number
("1 warning", "2 GPUs"), never "(s)"."""
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


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """"1 warning", "3 warnings" (`nouns` for an irregular plural)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
