"""Proposer: the one protocol every speculative method speaks, so the Speculator, the KV sizing and the memory
report treat n-gram, a draft model and an MTP head alike (vLLM v1's shape: each proposer a class the engine
calls the same way).

A step calls a proposer three times: `propose_before_schedule` for each running sequence that decodes next
(its drafts, or placeholders the scheduler reserves slots for), `fill_drafts` once the step is scheduled (the
drafts of the sequences that got slots, the proposer's half of the copy-on-write block copies, and q for the
rejection sampler when the drafts were sampled), and `after_step` once the scheduler has advanced
`num_computed_tokens` (what the proposer keeps in step with the target). A proposer with a model says what it
holds: `weights_bytes`, `kv_bytes_per_block` (a page of its own KV at every block id of the target's pool,
which the sizing shares the budget with) and its KV tensor. The defaults here are a proposer without a model
(n-gram): nothing to fill, nothing held. Proposers are built by engine/spec_decode/loading.py; this module
imports nothing that drafts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Proposer:
    name = "proposer"  # what log lines call it: "n-gram", "draft model", "MTP head"

    def propose_before_schedule(self, seq, max_drafts: int) -> list[int]:
        """Before scheduling: up to `max_drafts` (>= 1) drafts for a running sequence whose next step is a decode,
        or as many placeholders that `fill_drafts` replaces; [] for none. The scheduler may trim them."""
        raise NotImplementedError

    def fill_drafts(self, scheduled: list, block_copies: list[tuple[int, int]],
                    generator: torch.Generator | None) -> torch.Tensor | None:
        """After scheduling: each scheduled item with draft slots gets its `item.num_draft_tokens` drafts in
        `item.seq.spec_token_ids`. Returns q, the distribution each draft was drawn from ([sum of drafts, vocab]
        on the device, rows in the items' order), or None when the drafts are deterministic for the rejection
        sampler (q one-hot at the draft)."""
        return None

    def after_step(self, verified: list) -> None:
        """After the step, the scheduler's counts advanced; `verified`: the scheduled items whose drafts the
        rejection sampler judged (their `num_accepted` set)."""

    def weights_bytes(self) -> int:
        return 0

    def kv_bytes_per_block(self, kv_dtype_bytes: int) -> int:
        """Bytes of the proposer's own KV at one block id of the target's pool (it shares the target's block ids)."""
        return 0

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """Its KV tensor, over the same `num_blocks` block ids as the target's pool."""

    def kv_cache_bytes(self) -> int:
        return 0
