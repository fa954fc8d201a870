"""Which doctor checks run, in what order, and how each result becomes a row with its remedy.

Software and NVML rows always; the on-card checks only when torch can use CUDA. Every check is guarded:
an exception becomes a `fail` row carrying the error's first line, never a traceback that hides the rest
of the table.
"""
from __future__ import annotations

import os
from itertools import permutations
from typing import Callable

from engine.doctor.report import Row
from engine.doctor.system import nvidia_rows, software_rows


def collect_rows(nvml=None) -> list[Row]:
    import torch
    rows = software_rows()
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            rows.append(Row("NVIDIA GPU", "warn", "nvidia-ml-py is not installed, so cards cannot be listed",
                            "pip install nvidia-ml-py"))
    if nvml is not None:
        rows += nvidia_rows(nvml, torch.version.cuda, available, count)
    if available:
        rows += gpu_rows(count)
    return rows


def guarded(check: str, run: Callable[[], Row], remedy: str) -> Row:
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - the doctor reports failures, it does not stop on them
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return Row(check, "fail", f"{type(e).__name__}: {first_line}"[:300], remedy)


def gpu_rows(count: int) -> list[Row]:
    import torch
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    rows = [guarded(f"Triton attention cuda:{i}", lambda i=i: _parity_row(f"cuda:{i}", dtype, dtype),
                    "serve with --attention-backend torch (slower) and report the card and driver")
            for i in range(count)]
    rows += [guarded(f"FP8 KV cache ({name})", lambda fp8=fp8, name=name: _parity_row("cuda:0", dtype, fp8, name),
                     "do not use --kv-cache-dtype fp8 on this card")
             for name, fp8 in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2))]
    rows += [guarded(f"P2P cuda:{a}->cuda:{b}", lambda a=a, b=b: _peer_row(a, b),
                     "tensor parallel still works through host memory (NCCL_P2P_DISABLE=1)")
             for a, b in permutations(range(count), 2)]
    if count >= 2:
        rows.append(guarded("NCCL all-reduce", lambda: _allreduce_row(count),
                            "tensor parallel will fail: rerun with NCCL_DEBUG=INFO to see why; try NCCL_P2P_DISABLE=1"))
    rows.append(guarded("Decode speed", lambda: _decode_row(dtype),
                        "the GPU path cannot decode: serve with --attention-backend torch and report the error"))
    return rows


def _parity_row(device: str, dtype, cache_dtype, name: str | None = None) -> Row:
    from engine.doctor.kernel_checks import attention_parity
    check = f"FP8 KV cache ({name})" if name else f"Triton attention {device}"
    problem = attention_parity(device, dtype, cache_dtype)
    if problem:
        return Row(check, "fail", problem, "serve with --attention-backend torch"
                   + ("" if name is None else " or without --kv-cache-dtype fp8"))
    what = f"{name} cache written and read by Triton" if name else "compiled"
    return Row(check, "pass", f"{what}; matches the torch reference ({str(dtype).split('.')[-1]})")


def _peer_row(a: int, b: int) -> Row:
    from engine.doctor.kernel_checks import copy_bandwidth
    from engine.distributed.peer_access import peer_copy_works
    gbps = copy_bandwidth(f"cuda:{a}", f"cuda:{b}")
    if peer_copy_works(a, b):
        return Row(f"P2P cuda:{a}->cuda:{b}", "pass", f"peer copy intact, {gbps:.1f} GB/s")
    return Row(f"P2P cuda:{a}->cuda:{b}", "warn", f"no working peer-to-peer; copies go through host memory at "
                                                  f"{gbps:.1f} GB/s",
               "nothing to do: the engine sets NCCL_P2P_DISABLE=1; for speed, disable the IOMMU/ACS in the BIOS")


def _allreduce_row(count: int) -> Row:
    from engine.doctor.allreduce import allreduce_bus_bandwidth
    from engine.distributed.peer_access import nccl_environment, peer_copy_works
    env = nccl_environment(count, peer_copy_works, os.environ)
    gbps = allreduce_bus_bandwidth(count, "nccl", env=env)
    how = " with NCCL_P2P_DISABLE=1" if env else ""
    return Row("NCCL all-reduce", "pass", f"{gbps:.1f} GB/s bus bandwidth over {count} cards{how} (64 MiB)")


def _decode_row(dtype) -> Row:
    from engine.doctor.kernel_checks import decode_tokens_per_s
    tps = decode_tokens_per_s("cuda:0", dtype, "triton")
    return Row("Decode speed", "pass", f"{tps:,.0f} tokens/s on cuda:0 (tiny random 4-layer Llama, batch 16, eager)")
