"""--mm-processor-kwargs (vLLM's flag and JSON form): settings handed to the checkpoint's HF image processor, so it
resizes large images down before they reach the encoder. The keys each family's processor takes, checked at the
start (an unknown key is refused by name with the ones the family accepts), the keyword arguments the HF processor
is built with (the same ones make HF's own processor agree with the engine's), and the processor's largest image
after them, which engine/planning/vision.py's one rule (largest_image_embeds) reads. Qwen takes vLLM's
`max_pixels`/`min_pixels` (smart_resize's bounds); Pixtral its `longest_edge` (HF's size["longest_edge"]); Gemma 4
its `max_soft_tokens` budget; Gemma 3 resizes every image to one fixed square and takes none (`max_pixels` there is
refused by name, not ignored: it could not make an image any cheaper). Torch-free: the planners read it.
"""
from __future__ import annotations

import json
from typing import Any

from engine.config.vision import VisionConfig

# The keys each family's processor takes here (vLLM's names where vLLM has them).
ACCEPTED_KEYS = {"qwen3_5": ("max_pixels", "min_pixels"), "pixtral": ("longest_edge",),
                 "gemma4": ("max_soft_tokens",), "gemma3": ()}
GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the budgets Gemma 4's processor supports


def parse_mm_processor_kwargs(value: str | dict | None) -> dict[str, Any]:
    """--mm-processor-kwargs as a dict ({} when not given); a ValueError for anything but a JSON object."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--mm-processor-kwargs must be JSON such as '{{\"max_pixels\": 1003520}}': {exc}") \
                from None
    if not isinstance(value, dict):
        raise ValueError(f"--mm-processor-kwargs must be a JSON object, got {value!r}")
    return value


def hf_processor_kwargs(vision: VisionConfig, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments the family's HF image processor is built with for `kwargs` (checked: a ValueError
    naming an unknown key and the accepted ones, or a value out of range)."""
    accepted = ACCEPTED_KEYS[vision.kind]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        why = {"gemma3": " (Gemma 3's processor resizes every image to its fixed square: no setting makes an image "
                         "fewer tokens)",
               "gemma4": " (Gemma 4 bounds an image by its soft-token budget, not pixels)",
               "pixtral": " (Pixtral bounds an image by its longest edge, in pixels)"}.get(vision.kind, "")
        raise ValueError(f"--mm-processor-kwargs: {unknown} not taken by this checkpoint's image processor "
                         f"({vision.kind}); it accepts {list(accepted)}{why if 'max_pixels' in unknown else ''}")
    for key, value in kwargs.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--mm-processor-kwargs: {key} must be a whole number >= 1, got {value!r}")
    if vision.kind == "gemma4" and "max_soft_tokens" in kwargs and kwargs["max_soft_tokens"] not in \
            GEMMA4_SOFT_TOKENS:
        raise ValueError(f"--mm-processor-kwargs: max_soft_tokens must be one of {list(GEMMA4_SOFT_TOKENS)}, got "
                         f"{kwargs['max_soft_tokens']}")
    if kwargs.get("min_pixels", 0) > kwargs.get("max_pixels", kwargs.get("min_pixels", 0)):
        raise ValueError(f"--mm-processor-kwargs: min_pixels {kwargs['min_pixels']} is above max_pixels "
                         f"{kwargs['max_pixels']}")
    if vision.kind == "pixtral" and "longest_edge" in kwargs:
        edge = int(vision.tower.get("image_size", 1540))
        if kwargs["longest_edge"] > edge:  # the tower's 2-D positions reach image_size / patch_size per side
            raise ValueError(f"--mm-processor-kwargs: longest_edge {kwargs['longest_edge']} is beyond what this "
                             f"checkpoint's tower is built for ({edge} pixels)")
        return {"size": {"longest_edge": kwargs["longest_edge"]}}
    return dict(kwargs)  # Qwen's processor maps max_pixels/min_pixels onto its size itself


def processor_max_embeds(vision: VisionConfig, kwargs: dict[str, Any], default: int) -> int:
    """The most embeddings one image becomes once `kwargs` resize it, `default` (the processor's own) where they
    leave that alone: Qwen's smart_resize keeps an image within max_pixels (whole patch x merge units, lower or
    higher than its own); Pixtral's longest edge bounds a square of whole merged patches; Gemma 4's budget is its
    count."""
    if vision.kind == "qwen3_5" and "max_pixels" in kwargs:
        unit = int(vision.tower.get("patch_size", 16)) * vision.spatial_merge_size
        return kwargs["max_pixels"] // (unit * unit)
    if vision.kind == "pixtral" and "longest_edge" in kwargs:
        side = kwargs["longest_edge"] // (vision.patch_size * vision.spatial_merge_size)
        return side * side
    if vision.kind == "gemma4" and "max_soft_tokens" in kwargs:
        return kwargs["max_soft_tokens"]
    return default
