"""MultiModalItem and MultiModalInputs: a prompt's images as the engine carries them, from the processor to the
encoder step.

An item is one image: where its placeholder tokens sit in the prompt (`offset`, `length`), which of them take an
embedding (`is_embed`: Pixtral's row-break and end tokens are placeholders that keep their own embedding), the hash
of its content (the encoder cache's key and part of the prefix-cache hash of every block it touches) and the
processor's tensors the tower reads (`data`). Plain data: the scheduler reads offsets and counts, the worker the
tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ProfileImage:
    """The startup profile's image as its size alone: each tensor-parallel rank makes the processor's tensors of
    this blank image itself (engine/multimodal/processor.profile_pixels), since at Qwen's largest they are
    ~400 MB of float32 pixels, too much for the command pipe to every worker."""

    model_path: str  # the folder whose image processor makes the tensors
    width: int
    height: int
    processor_kwargs: dict[str, Any] = field(default_factory=dict)  # HF's, from --mm-processor-kwargs


@dataclass(slots=True)
class MultiModalItem:
    mm_hash: str  # sha256 of the decoded image (mode, size, pixels): equal images share an encoding
    offset: int  # the first placeholder token's index in the prompt
    length: int  # placeholder tokens, Pixtral's break/end tokens included
    num_embeds: int  # embeddings the tower makes for it (is_embed.sum())
    data: dict[str, Any] = field(default_factory=dict, repr=False)  # the processor's tensors for this image
    is_embed: np.ndarray | None = field(default=None, repr=False)  # [length] bool; None: every placeholder
    modality: str = "image"

    @property
    def end(self) -> int:
        return self.offset + self.length

    def embed_range(self, start: int, stop: int) -> tuple[int, int, np.ndarray]:
        """For prompt positions [start, stop) (clipped to this item): the embeddings they take, as (first, last+1)
        into the item's embeddings, and the prompt positions that take them."""
        lo, hi = max(start, self.offset), min(stop, self.end)
        if lo >= hi:
            return 0, 0, np.zeros(0, dtype=np.int64)
        if self.is_embed is None:
            return lo - self.offset, hi - self.offset, np.arange(lo, hi, dtype=np.int64)
        before = int(self.is_embed[:lo - self.offset].sum())
        mask = self.is_embed[lo - self.offset:hi - self.offset]
        return before, before + int(mask.sum()), np.flatnonzero(mask).astype(np.int64) + lo


@dataclass(slots=True)
class MultiModalInputs:
    prompt_token_ids: list[int]
    items: list[MultiModalItem]
    # Qwen's mRoPE: the prompt's three position streams (temporal, height, width) and the offset every later token's
    # position has from its index (HF's rope_deltas); None for the other families.
    mrope_positions: np.ndarray | None = field(default=None, repr=False)  # [3, len(prompt)] int64
    mrope_delta: int = 0

    def block_keys(self, block: int, block_size: int) -> tuple[str, ...]:
        """The hashes of the images whose placeholders prompt block `block` holds (vLLM's mm_hash in the block
        hash): the same text with another image is another block."""
        lo, hi = block * block_size, (block + 1) * block_size
        return tuple(item.mm_hash for item in self.items if item.offset < hi and item.end > lo)
