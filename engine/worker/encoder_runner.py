"""The encoder step beside the model runner: images through the family's vision tower, their embeddings kept on the
device until the scheduler's encoder cache lets them go, and each step's placeholder rows filled from them.

Per step, before the forward: drop the entries the scheduler evicted (`StepInputs.mm_free`), encode the step's new
images (`mm_encode`, each through `model.encode_image`), then gather the embeddings the step's placeholder rows take
(`mm_slices` over `mm_rows`) into one tensor the model writes over those rows' token embeddings. Every
tensor-parallel rank runs the same (the towers are replicated, engine/models/vision.py). An image whose
embeddings do not come out as many as its placeholders is an error naming both counts.
"""
from __future__ import annotations

import torch

from engine.platform.host_copies import to_device
from engine.worker.step_inputs import StepInputs


class EncoderRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.cache: dict[str, torch.Tensor] = {}  # content hash -> [num_embeds, hidden] on the device

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token rows, embeddings) of the step's image placeholders, or None when it has none."""
        for mm_hash in inputs.mm_free:
            self.cache.pop(mm_hash, None)
        for mm_hash, data in inputs.mm_encode:
            if mm_hash not in self.cache:
                self.cache[mm_hash] = self.encode(data)
        if inputs.mm_rows is None:
            return None
        parts = []
        for mm_hash, lo, hi in inputs.mm_slices:
            embeds = self.cache.get(mm_hash)
            if embeds is None:
                raise RuntimeError(f"image {mm_hash[:12]} has no embeddings in the encoder cache (never encoded, or "
                                   "dropped while a prompt still needed it)")
            if hi > len(embeds):
                raise RuntimeError(f"image {mm_hash[:12]}: its tower made {len(embeds)} embeddings, its placeholders "
                                   f"take {hi}")
            parts.append(embeds[lo:hi])
        rows = to_device(torch.from_numpy(inputs.mm_rows), self.device)
        return rows, torch.cat(parts)

    def encode(self, data: dict) -> torch.Tensor:
        """One image's embeddings [num_embeds, hidden] from the processor's tensors, in the model's dtype."""
        return self.model.encode_image(data).to(self.dtype)

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.cache.values())
