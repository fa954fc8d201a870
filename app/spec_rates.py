"""Speculative-decoding rates per engine-state interval, from the stream's cumulative counters.

The engine-state document's "spec_decode" holds totals since the engine started (drafts verified, draft
tokens proposed, draft tokens accepted). The Monitor plots what happened since the previous document: the
acceptance rate (accepted / proposed draft tokens) and the mean accepted length (tokens a verify step emits:
1 + accepted / drafts). An interval with no verify step has no rate (the plot shows a gap, not a zero), and
counters that went backwards (the engine restarted) start afresh. Pure functions, no Qt.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecRates:
    acceptance_rate: float  # 0..1
    mean_accepted_length: float  # >= 1


class SpecRateTracker:
    def __init__(self) -> None:
        self._last: tuple[int, int, int] | None = None

    def update(self, spec_decode: dict | None) -> SpecRates | None:
        """The rates since the previous call's totals; None when no draft was verified in between."""
        if not spec_decode:
            self._last = None
            return None
        now = (int(spec_decode.get("num_drafts", 0)), int(spec_decode.get("num_draft_tokens", 0)),
               int(spec_decode.get("num_accepted_tokens", 0)))
        last, self._last = self._last, now
        if last is None:  # the first sample is only the next interval's base
            return None
        if any(n < b for n, b in zip(now, last)):  # the engine restarted: its counters count from zero
            last = (0, 0, 0)
        drafts, proposed, accepted = (n - b for n, b in zip(now, last))
        if drafts <= 0 or proposed <= 0:
            return None
        return SpecRates(accepted / proposed, 1.0 + accepted / drafts)

    def reset(self) -> None:
        self._last = None
