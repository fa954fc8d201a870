"""Speculator: the engine's one handle on speculative decoding, called at four points of a step.

It holds one proposer (engine/spec_decode/proposers/base.Proposer: n-gram, a draft model or an MTP head, built
by engine/spec_decode/loading.py) and never asks which: the hooks below do what every method shares and call
the proposer's hook of the same name for the rest.

1. `propose_before_schedule`: each running sequence that decodes next gets the proposer's drafts (or
   placeholders for drafts made after scheduling) in `seq.spec_token_ids`, capped so that max_tokens and
   max_model_len are never passed; the scheduler then schedules 1 + drafts query tokens and reserves their
   slots as lookahead (never hashed for the prefix cache).
2. `fill_drafts`: after scheduling, the proposer fills the drafts of the sequences that got draft slots (and
   copies its own KV blocks); the draft distribution q it returns is kept for the verify rows.
3. `plan_rows`: one `SamplingRow` per verify position (the sequence's tokens plus the drafts before it,
   so penalties, bad_words and min_tokens see them), the grammar bitmask per position (the matcher
   advanced through the drafts, then rolled back), and the rows of q those drafts were drawn from.
4. `after_step`: acceptance counted in `SpecDecodeStats`, and the proposer told what the step kept.

Requests with beam search or prompt logprobs never speculate (one log line per request). This module imports
no proposer: the engine core may import it without the worker or the models.
"""
from __future__ import annotations

import logging

import torch

from engine.sample.metadata import SamplingRow
from engine.config.speculative import SpeculativeConfig
from engine.spec_decode.metrics import SpecDecodeStats
from engine.spec_decode.proposers.base import Proposer
from engine.structured_output.bitmask import allocate_bitmask, ids_bitmask

logger = logging.getLogger("pagedesk.engine")


class SpecBatch:
    """The verify rows of one step, for the model runner: `rows[i]` reads logits row `logits_index[i]`."""

    __slots__ = ("rows", "logits_index", "draft_token_ids", "bitmask", "draft_probs", "q_index")

    def __init__(self) -> None:
        self.rows: list[SamplingRow] = []
        self.logits_index: list[int] = []
        self.draft_token_ids: list[list[int]] = []  # per verified sequence
        self.bitmask: torch.Tensor | None = None  # [len(rows), words] host side, or None
        self.draft_probs: torch.Tensor | None = None  # the draft's q per draft row, on the device
        self.q_index: list[int] = []  # rows of the step's q tensor, in draft-row order


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, eos_ids: list[int], vocab_size: int,
                 proposer: Proposer) -> None:
        self.config, self.k, self.proposer = config, config.num_speculative_tokens, proposer
        self.max_model_len, self.eos_ids, self.vocab_size = max_model_len, eos_ids, vocab_size
        self.stats = SpecDecodeStats(num_speculative_tokens=config.k, method=config.method)
        self._said_off: set[str] = set()
        self._draft_probs: torch.Tensor | None = None  # this step's q, rows in the order drafts were made
        self._q_rows: dict[int, int] = {}  # seq_id -> its first row in _draft_probs

    def eligible(self, seq) -> bool:
        request = seq.request
        if request.beam is None and request.params.prompt_logprobs is None:
            return True
        if request.request_id not in self._said_off:
            self._said_off.add(request.request_id)
            logger.info("request %s runs without speculative decoding (%s)", request.request_id,
                        "beam search" if request.beam is not None else "prompt_logprobs")
        return False

    def max_drafts(self, seq) -> int:
        """Drafts that cannot overshoot: every accepted draft plus the bonus token must fit max_tokens and
        max_model_len."""
        p = seq.params
        cap = self.max_model_len - seq.num_tokens - 1
        if p.max_tokens is not None:
            cap = min(cap, p.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.k, cap))

    def propose_before_schedule(self, running: list) -> None:
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.request.paused or not self.eligible(seq):
                continue
            cap = self.max_drafts(seq)
            if cap:
                seq.spec_token_ids = self.proposer.propose_before_schedule(seq, cap)

    def fill_drafts(self, scheduled: list, block_copies: list[tuple[int, int]], generator) -> None:
        """The proposer's drafts for the scheduled sequences with draft slots, and their q (if sampled)."""
        self._draft_probs, self._q_rows = None, {}
        q = self.proposer.fill_drafts(scheduled, block_copies, generator)
        if q is None:
            return
        start = 0
        for item in scheduled:
            if item.num_draft_tokens:
                self._q_rows[item.seq.seq_id] = start
                start += item.num_draft_tokens
        self._draft_probs = q

    def plan_rows(self, batch: SpecBatch, seq, first_logits_row: int, allowed_ids: list[int] | None) -> None:
        """Add one sequence's verify rows (1 + drafts, from `first_logits_row`) to the step's SpecBatch."""
        drafts = seq.spec_token_ids
        rows = []
        for j in range(len(drafts) + 1):
            tokens = seq.token_ids + drafts[:j] if j else seq.token_ids
            rows.append(SamplingRow(seq.params, tokens, seq.num_prompt_tokens, seq.generator, self.eos_ids))
        grammar_mask = self._grammar_rows(seq, drafts, allowed_ids)
        if grammar_mask is not None or batch.bitmask is not None:
            done = allocate_bitmask(len(batch.rows), self.vocab_size) if batch.bitmask is None else batch.bitmask
            mine = grammar_mask if grammar_mask is not None else allocate_bitmask(len(rows), self.vocab_size)
            batch.bitmask = torch.cat([done, mine])
        batch.rows += rows
        batch.logits_index += range(first_logits_row, first_logits_row + len(rows))
        batch.draft_token_ids.append(list(drafts))
        if self._draft_probs is not None:
            start = self._q_rows[seq.seq_id]
            batch.q_index += range(start, start + len(drafts))

    def finish_batch(self, batch: SpecBatch) -> None:
        """The step's q rows for the verified sequences (a request that failed planning left its rows out)."""
        if self._draft_probs is not None and batch.q_index:
            q = self._draft_probs
            batch.draft_probs = q if batch.q_index == list(range(len(q))) else q[torch.as_tensor(batch.q_index,
                                                                                                  device=q.device)]
        self._draft_probs, self._q_rows = None, {}

    def _grammar_rows(self, seq, drafts: list[int], allowed_ids: list[int] | None) -> torch.Tensor | None:
        """Bitmask rows for each verify position: the matcher advanced through the drafts before it (a draft
        the grammar refuses ends the advance: the rows after it can never be reached), then rolled back."""
        grammar = seq.grammar
        if grammar is None and allowed_ids is None:
            return None
        mask = allocate_bitmask(len(drafts) + 1, self.vocab_size)
        advanced = 0
        if grammar is not None:
            matcher = grammar.matcher
            for j in range(len(drafts) + 1):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(mask, j)
                if j == len(drafts) or not grammar.try_accept(drafts[j]):
                    break
                advanced += 1
            if advanced:
                matcher.rollback(advanced)
        if allowed_ids is not None:
            mask &= ids_bitmask(allowed_ids, self.vocab_size)
        return mask

    def after_step(self, items: list, result) -> None:
        """Count each verified proposal (as the rejection sampler judged it) and let the proposer catch up on
        what the step kept. Runs after the scheduler advanced num_computed_tokens."""
        judged = [] if not items or result is None or result.spec is None else \
            list(zip(items, result.spec.num_accepted))
        for item, accepted in judged:
            self.stats.observe(item.num_draft_tokens, accepted)
        self.proposer.after_step([item for item, _ in judged])
