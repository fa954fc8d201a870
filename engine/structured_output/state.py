"""GrammarState: one sequence's position in its grammar (an xgrammar matcher), advanced token by token.

Each of a request's n sequences has its own state; they start from the same compiled grammar, so a
fork before the first token is just a fresh matcher. Preemption keeps the state: recomputing a
sequence's KV cache replays no tokens through the matcher. A special token (one xgrammar never lets a
grammar match: BOS, padding, template markers) is refused here before xgrammar sees it, since xgrammar
writes a warning line for each one it refuses (a speculative draft proposes them often); a sampled token
the grammar refuses, which means its mask was bypassed, is logged by us, at most once a minute.
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("pagedesk.engine")
REFUSAL_LOG_INTERVAL_S = 60.0
_refusals = {"last": float("-inf"), "quiet": 0}


class GrammarState:
    def __init__(self, compiled) -> None:
        import xgrammar as xgr
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.special_ids = frozenset(compiled.tokenizer_info.special_token_ids)
        self.num_accepted = 0
        self.rejected = False  # a token the grammar refused was appended (only if the mask was bypassed)

    def fork(self) -> "GrammarState":
        assert self.num_accepted == 0, "forks happen before a sequence's first token"
        return GrammarState(self.compiled)

    def try_accept(self, token_id: int) -> bool:
        """The matcher's accept_token, a special token refused without xgrammar's warning line."""
        return token_id not in self.special_ids and bool(self.matcher.accept_token(token_id))

    def accept(self, token_id: int) -> bool:
        if self.matcher.is_terminated():
            return False
        ok = self.try_accept(token_id)
        self.num_accepted += ok
        if not ok:
            self.rejected = True
            _log_refusal(token_id)
        return ok

    @property
    def terminated(self) -> bool:
        """The grammar reached its end (it accepted a stop token): nothing more may be generated."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def _log_refusal(token_id: int) -> None:
    now = time.monotonic()
    if now - _refusals["last"] < REFUSAL_LOG_INTERVAL_S:
        _refusals["quiet"] += 1
        return
    quiet, _refusals["quiet"], _refusals["last"] = _refusals["quiet"], 0, now
    log.warning("structured output: token %d was refused by its request's grammar (the sequence ends there)%s",
                token_id, f"; {quiet} more since the last such line" if quiet else "")
