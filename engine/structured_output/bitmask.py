"""Per-step token bitmask: pack the allowed tokens of each sampling row that has a grammar.

The mask is int32 `[rows, ceil(vocab / 32)]` (bit j of word w allows token 32 w + j, xgrammar's layout),
all ones for rows without a grammar. It is filled on the host by the matchers (microseconds per row);
the sampler applies it on the logits' device (`engine.sample.sampler.apply_token_bitmask`).
"""
from __future__ import annotations

import torch


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def ids_bitmask(ids: list[int], vocab_size: int) -> torch.Tensor:
    """One row allowing exactly `ids`."""
    ids_t = torch.tensor(sorted(set(ids)), dtype=torch.int64)
    words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int64)
    words.index_add_(0, ids_t // 32, torch.ones_like(ids_t) << (ids_t % 32))  # distinct bits: the sum is an OR
    return (words - (words >= 2**31) * 2**32).to(torch.int32)  # bit 31 as int32's sign bit


def grammar_bitmask(grammars: list, vocab_size: int, allowed_ids: list | None = None) -> torch.Tensor | None:
    """The step's bitmask: each row's grammar (GrammarState or None) and its allowed_token_ids (a list or
    None) both apply; None when no row has either."""
    allowed_ids = allowed_ids or [None] * len(grammars)
    if grammars.count(None) == len(grammars) and allowed_ids.count(None) == len(allowed_ids):  # every step asks
        return None
    bitmask = allocate_bitmask(len(grammars), vocab_size)
    for row, (grammar, ids) in enumerate(zip(grammars, allowed_ids)):
        if grammar is not None and not grammar.terminated:
            grammar.fill_bitmask(bitmask, row)
        if ids is not None:
            bitmask[row] &= ids_bitmask(ids, vocab_size)
    return bitmask
