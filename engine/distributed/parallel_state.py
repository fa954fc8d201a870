"""The tensor-parallel group of this process: rank, size and the collectives the layers call.

Set once per process by `init_tensor_parallel` before the model is built (rank 0 in the engine process,
ranks 1.. in spawned workers); with one rank every collective is a no-op, so single-device runs never
touch torch.distributed. `init_distributed` also joins the torch.distributed group (gloo on CPU, NCCL on
CUDA) through a FileStore in a per-engine temporary folder: rendezvous never opens a listening socket,
and gloo's own data connections are pinned to the loopback interface.
"""
from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
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


@contextmanager
def single_rank():
    """Build or run a model on this rank alone, unsharded and with no collectives (the draft model of
    speculative decoding lives on rank 0 only). The engine's one thread drives both models, so swapping the
    process's group for the duration is safe; the target's forward never runs inside this block."""
    global _group
    saved, _group = _group, TensorParallelGroup()
    try:
        yield
    finally:
        _group = saved


def init_distributed(rank: int, size: int, backend: str, store_path: str, timeout_s: float) -> None:
    """Join the `size`-rank torch.distributed group and make it this process's tensor-parallel group.

    Blocks until every rank has joined. `timeout_s` bounds rendezvous and every collective."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel "
                           "engine per process; shut the other engine down first")
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    else:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    init_tensor_parallel(rank, size)


def destroy_distributed(abort: bool = False) -> None:
    """Leave the group; `abort` (a peer died) drops NCCL communicators without waiting on their kernels."""
    init_tensor_parallel(0, 1)
    if not dist.is_initialized():
        return
    if abort and dist.get_backend() == "nccl":
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # best effort (a private, NCCL-only API): the engine is failing anyway
            pass
    if dist.is_initialized():
        dist.destroy_process_group()


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
