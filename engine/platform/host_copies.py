"""Host buffers the device copies from: pinned where a card can DMA them, non-blocking copies, and the fence
that keeps a host write from overtaking a copy still queued. Shared by the input batch (engine/worker), the
sampling state and the speculative proposers."""
from __future__ import annotations

import numpy as np
import torch


class CopyFence:
    """Guards the reuse of a pinned host buffer: its next write waits until the asynchronous copies issued
    from it have run. A step that ends in a host sync (the sampler's result copy) makes every wait free, but
    a worker that never syncs (tensor parallel, no acknowledgement) or a step with nothing to sample would
    otherwise overwrite cells a queued DMA has not read yet. Off the card (pageable host memory, where a copy
    is done when it returns) it is a no-op."""

    __slots__ = ("enabled", "event", "pending")

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.event, self.pending = enabled, None, False

    def record(self) -> None:
        """After issuing copies from the buffer, on the current stream."""
        if self.enabled:
            if self.event is None:
                self.event = torch.cuda.Event()
            self.event.record()
            self.pending = True

    def wait(self) -> None:
        """Before writing the buffer."""
        if self.pending:
            self.event.synchronize()
            self.pending = False


def pins_host_buffers(device: torch.device) -> bool:
    """Whether host buffers feeding `device` are page-locked: on a real card (fake CUDA tensors have no driver)."""
    return device.type == "cuda" and torch.cuda.is_available()


def host_buffer(shape: tuple[int, ...], dtype, pin: bool) -> tuple[torch.Tensor, np.ndarray]:
    """A zeroed host buffer as a tensor and a numpy view of the same memory: page-locked with `pin` (the
    copy to the card is then a true asynchronous DMA), plain numpy memory otherwise."""
    if pin:
        host = torch.zeros(shape, dtype=torch.from_numpy(np.zeros(0, dtype)).dtype, pin_memory=True)
        return host, host.numpy()
    host_np = np.zeros(shape, dtype=dtype)
    return torch.from_numpy(host_np), host_np


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: through pinned memory, `non_blocking`, on a
    card (PyTorch's pinned allocator keeps the staging memory alive until the copy has run)."""
    if device.type == "cpu":  # the tensor is there already (a `to` would still go through the dispatcher)
        return t
    if device.type != "cuda":
        return t.to(device)
    if torch.cuda.is_available():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
