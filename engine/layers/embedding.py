"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary.

A scaled embedding (Gemma's, times sqrt(hidden_size)) multiplies by its scale as HF does: a float32 number rounded to
the weights' dtype. That rounding is done once, into a buffer on the device, never per forward: a host number
turned into a device tensor inside forward is a pageable copy, which CUDA graph capture refuses.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None) -> None:
        super().__init__()
        tp = get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + tp - 1) // tp  # the last rank's slice is zero-padded
        self.vocab_start = get_tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        scale_tensor = None if scale is None else torch.tensor(scale, dtype=torch.float32).to(self.weight.dtype)
        self.register_buffer("embed_scale", scale_tensor, persistent=False)  # HF's rounding, made once

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self._lookup(input_ids)
        return out if self.embed_scale is None else out * self.embed_scale

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(F.linear(hidden, self.weight))[..., :self.vocab_size]
