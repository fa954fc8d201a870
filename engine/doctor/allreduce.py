"""All-reduce bandwidth between the cards, the way tensor parallel uses them: one spawned process per rank.

Ranks join through a FileStore in a temporary folder (no listening socket), with the NCCL variables the
engine itself would set (NCCL_P2P_DISABLE=1 when a peer copy fails), and report the bus bandwidth of
repeated all-reduces (nccl-tests' definition: algorithm bandwidth × 2(n−1)/n). With backend "gloo" on
CPU tensors the same code runs without a GPU, which is how it is tested.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import tempfile
import time

import torch
import torch.distributed as dist


def allreduce_bus_bandwidth(world_size: int, backend: str = "nccl", nbytes: int = 64 * 2**20, iters: int = 10,
                            env: dict[str, str] | None = None, timeout_s: float = 120.0) -> float:
    """GB/s of bus bandwidth; raises RuntimeError with the rank's message when a rank fails or hangs."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pagedesk-doctor-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(rank, world_size, backend, store, nbytes, iters, env or {},
                                                      timeout_s, results), daemon=True) for rank in range(world_size)]
        for p in procs:
            p.start()
        try:
            answers = dict(results.get(timeout=timeout_s) for _ in procs)
        except Exception as e:  # queue.Empty: a rank hung (a broken P2P path often looks like this)
            raise RuntimeError(f"all-reduce did not finish within {timeout_s:.0f} s") from e
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    errors = [a for a in answers.values() if isinstance(a, str)]
    if errors:
        raise RuntimeError(errors[0])
    return min(answers.values())


def _rank_main(rank, world_size, backend, store_path, nbytes, iters, env, timeout_s, results) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME", "lo")
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(2):  # warm-up: NCCL builds its rings on the first call
            dist.all_reduce(x)
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        _sync(device)
        elapsed = (time.perf_counter() - start) / iters
        results.put((rank, nbytes / elapsed * 2 * (world_size - 1) / world_size / 1e9))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the parent as this rank's answer
        results.put((rank, f"rank {rank}: {type(e).__name__}: {e}"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
