"""GrammarState: one sequence's position in its grammar (an xgrammar matcher), advanced token by token.

Each of a request's n sequences has its own state; they start from the same compiled grammar, so a
fork before the first token is just a fresh matcher. Preemption keeps the state: recomputing a
sequence's KV cache replays no tokens through the matcher.
"""
from __future__ import annotations

import torch


class GrammarState:
    def __init__(self, compiled) -> None:
        import xgrammar as xgr
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0
        self.rejected = False  # a token the grammar refused was appended (only if the mask was bypassed)

    def fork(self) -> "GrammarState":
        assert self.num_accepted == 0, "forks happen before a sequence's first token"
        return GrammarState(self.compiled)

    def accept(self, token_id: int) -> bool:
        if self.matcher.is_terminated():
            return False
        ok = bool(self.matcher.accept_token(token_id))
        self.num_accepted += ok
        self.rejected |= not ok
        return ok

    @property
    def terminated(self) -> bool:
        """The grammar reached its end (it accepted a stop token): nothing more may be generated."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
