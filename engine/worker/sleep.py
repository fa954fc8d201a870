"""Sleep mode's weights (vLLM's levels): where a rank's parameters and buffers go while the engine sleeps.

Level 1 copies every parameter and buffer to host RAM (pinned on a card, so waking is one DMA per tensor) and frees
the device copy; level 2 frees the parameters, keeping only their shapes (waking reloads them from the checkpoint
through the family's own `load_weights`), and keeps the buffers (RoPE tables, quantization zero points) in host RAM.
Only `.data` changes: each Parameter object keeps its weight loader and shard ids, so the model, its quantized layers
and everything that holds a module keep working. On CPU the weights already live in RAM: level 1 leaves them there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# What a parameter's weight loader remembers during one load (engine/layers/linear.py: the stacked shards whose g_idx
# it compared; engine/layers/fused_moe/layer.py: the experts' g_idx): forgotten before a level-2 reload, which is a
# first load again.
LOAD_RECORDS = ("loaded_shards", "loaded_g_idx")


@dataclass
class SleepingTensor:
    tensor: torch.Tensor  # the parameter or buffer, its data emptied while it sleeps
    shape: torch.Size
    dtype: torch.dtype
    host: torch.Tensor | None = None  # its values in host RAM (level 1, and buffers at level 2); None: reloaded


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = t.to("cpu")
    return host.pin_memory() if torch.cuda.is_available() else host


class SleepingWeights:
    def __init__(self, model: nn.Module, level: int, device: torch.device) -> None:
        """Put `model`'s weights to sleep at `level`; the device memory they held is free once this returns
        (to the caching allocator: the caller empties its cache)."""
        assert level in (1, 2), level
        self.level, self.device = level, device
        self.params = [SleepingTensor(p, p.shape, p.dtype) for p in model.parameters()]
        self.buffers = [SleepingTensor(b, b.shape, b.dtype) for b in model.buffers()]
        self.device_bytes = sum(p.tensor.numel() * p.tensor.element_size() for p in self.params)
        on_card = device.type == "cuda"
        kept = {id(t) for t in (self.params if level == 1 else []) + self.buffers}
        for t in (self.params + self.buffers) if on_card else (self.params if level == 2 else []):
            if id(t) in kept:
                t.host = _to_host(t.tensor.data)
            t.tensor.data = torch.empty(0, dtype=t.dtype, device=device)

    def wake(self, reload) -> None:
        """Weights back on the device; `reload()` (level 2) loads the checkpoint into the re-made parameters."""
        for t in self.params + self.buffers:
            if t.host is not None:
                t.tensor.data = t.host.to(self.device, non_blocking=True)
            elif t.tensor.numel() != t.shape.numel():
                t.tensor.data = torch.zeros(t.shape, dtype=t.dtype, device=self.device)  # rows no shard fills: 0
        if self.level == 2:
            for p in self.params:
                for record in LOAD_RECORDS:
                    p.tensor.__dict__.pop(record, None)
            reload()
