"""Per-step token bitmask: pack the allowed tokens of each row with a grammar, and apply them to logits.

The mask is int32 `[rows, ceil(vocab / 32)]` (bit j of word w allows token 32 w + j), all ones for
rows without a grammar. It is filled on the host by the matchers (microseconds per row) and applied
on the logits' device with tensor ops only, so it works the same on CPU, CUDA and fake tensors.
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


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of tokens the bitmask does not allow to -inf, in place, on the logits' device."""
    rows, vocab = logits.shape
    bits = bitmask.to(logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(rows, -1).narrow(1, 0, vocab)
    logits.masked_fill_(allowed == 0, float("-inf"))
