"""The tensor-parallel group of this process: rank, size and the collectives the layers call.

Set once per process by `init_tensor_parallel` before the model is built (rank 0 in the engine process,
ranks 1.. in spawned workers); with one rank every collective is a no-op, so single-device runs never
touch torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1


_group = TensorParallelGroup()


def init_tensor_parallel(rank: int, size: int) -> None:
    global _group
    _group = TensorParallelGroup(rank, size)


def get_tp_rank() -> int:
    return _group.rank


def get_tp_size() -> int:
    return _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _group.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension (vocab-parallel logits)."""
    if _group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
