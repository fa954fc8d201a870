"""Per-step token bitmask: pack the allowed tokens of each sampling row that has a grammar.

The mask is int32 `[rows, ceil(vocab / 32)]` (bit j of word w allows token 32 w + j, xgrammar's layout),
all ones for rows without a grammar. It is filled on the host by the matchers (microseconds per row);
the sampler applies it on the logits' device (`engine.sampler.apply_token_bitmask`).
"""
from __future__ import annotations

import torch


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def grammar_bitmask(grammars: list, vocab_size: int) -> torch.Tensor | None:
    """The step's bitmask for rows with a GrammarState (None entries are unconstrained); None if no row has one."""
    if all(g is None for g in grammars):
        return None
    bitmask = allocate_bitmask(len(grammars), vocab_size)
    for row, grammar in enumerate(grammars):
        if grammar is not None and not grammar.terminated:
            grammar.fill_bitmask(bitmask, row)
    return bitmask
