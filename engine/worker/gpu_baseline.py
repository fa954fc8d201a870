"""Free memory on a card as other programs left it, before this process's own CUDA context took its share.

The KV sizing counts `total - free at start` as "other programs" (the desktop, other processes), but
cudaMemGetInfo needs a context, so reading it creates this process's context first and its few hundred
MiB looked like another program: every start warned. `free_bytes_at_start` reads the card's free memory
through NVML (which needs no context) just before torch's first context on that card, and again just
after, and adds the difference back to torch's figure; the context then shows up where it belongs, in what
the process holds outside torch's allocator. A process that must make its context earlier (a
tensor-parallel rank's `set_device`) calls `record` first and the ModelRunner takes that reading. Without
NVML, or when the context already existed, the difference is 0 and nothing changes.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("pagedesk.engine")

_recorded: dict[int, tuple[int, int]] = {}  # CUDA device index -> (free bytes without our context, total)


def record(index: int) -> None:
    """Read the baseline now, before something else makes this process's context on `index`."""
    _recorded[index] = _measure(index)


def free_bytes_at_start(index: int) -> tuple[int, int]:
    """(free bytes before this process's CUDA context on `index`, total bytes): the reading `record` took,
    once, or one taken now. Creates the context."""
    return _recorded.pop(index, None) or _measure(index)


def _measure(index: int) -> tuple[int, int]:
    before = nvml_free_bytes(index)
    free, total = torch.cuda.mem_get_info(index)  # the first CUDA call that needs a context makes it
    after = nvml_free_bytes(index) if before is not None else None
    context = max(0, before - after) if after is not None else 0
    if context:
        logger.info("cuda:%d: this process's CUDA context takes %.0f MiB (not counted as other programs)",
                    index, context / 2**20)
    return min(total, free + context), total


def nvml_free_bytes(index: int) -> int | None:
    """NVML's free bytes on the card torch calls cuda:`index` (matched by UUID, so CUDA_VISIBLE_DEVICES and
    PCI ordering cannot mix cards up), or None when NVML cannot say."""
    try:
        import pynvml
        uuid = str(torch.cuda.get_device_properties(index).uuid)  # no context needed
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML (or no NVIDIA driver): fall back to torch's figure
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    except Exception:  # noqa: BLE001 - pynvml's error classes are generated per code
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
