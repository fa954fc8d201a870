"""N-gram (prompt lookup) proposer: drafts are the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, trying n from prompt_lookup_max down to prompt_lookup_min (vLLM's rule).

Host-side numpy over the sequence's own token list; no model, so under tensor parallel the drafts simply
travel in the step's input ids, and it holds no memory and fills nothing after scheduling: its drafts are
final before the scheduler sees them (the Proposer defaults). Repetitive text (code being edited, quoted
documents) is where it pays.
"""
from __future__ import annotations

import numpy as np

from engine.spec_decode.proposers.base import Proposer


class NgramProposer(Proposer):
    name = "n-gram"

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.k, self.max_n, self.min_n = num_speculative_tokens, prompt_lookup_max, prompt_lookup_min

    def propose_before_schedule(self, seq, max_drafts: int) -> list[int]:
        return self.propose(seq.token_ids, max_drafts)

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) draft tokens continuing `token_ids`, or [] when no n-gram matches."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # Windows of length n starting before the suffix itself (each must have a token after it).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence: the most local context
                return tokens[start:start + k].tolist()
        return []
