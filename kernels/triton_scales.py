"""Per-tensor FP8 scales as the 1-element fp32 device tensors the Triton kernels load.

Kernels read scales through a pointer so a scale that lives on the GPU is never synced to the host.
"""
from __future__ import annotations

import torch


def scale_tensor(scale: torch.Tensor | float | None, device: torch.device) -> torch.Tensor:
    """None means 1.0; a float becomes a fresh tensor; a 0-d/1-element tensor is viewed as fp32 ``[1]``."""
    if scale is None:
        scale = 1.0
    if isinstance(scale, torch.Tensor):
        assert scale.numel() == 1, f"per-tensor scale must have one element, got shape {tuple(scale.shape)}"
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)
