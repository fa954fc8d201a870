"""VisionConfig: what a vision-language checkpoint's config.json says about images, family by family.

Each family names the same few facts differently: the placeholder token that image embeddings replace
(Qwen's `image_token_id`, Gemma 3's `image_token_index`, Mistral3's `image_token_index`), the tokens around an
image (Qwen's vision start/end, Gemma's begin/end of image), how many embeddings one image becomes (Qwen: its
patch grid over spatial_merge_size², Gemma 3: `mm_tokens_per_image`, Pixtral: a row per patch row), whether a
prompt's image tokens see each other both ways (Gemma's token-type mask) and whether positions are Qwen's
three-stream mRoPE. This module reads them into one description; the tower's own shapes stay in `tower` (the
raw vision_config) for the family's vision module and the planner. Torch-free, so the GUI reads it too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Family kind per architecture whose vision tower the engine runs: which placeholder layout, tower and positions an
# image gets. A vision-language architecture not named here is served as text (its tower skipped).
VISION_KINDS = {
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "Qwen3VLForConditionalGeneration": "qwen3_5",  # Qwen3.5's tower, placeholders and mRoPE, plus DeepStack
    "Qwen3VLMoeForConditionalGeneration": "qwen3_5",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Mistral3ForConditionalGeneration": "pixtral",
    "Gemma4ForConditionalGeneration": "gemma4",
}


@dataclass(frozen=True)
class VisionConfig:
    kind: str  # one of VISION_KINDS' values
    image_token_id: int  # the placeholder each image embedding replaces
    tower: dict[str, Any] = field(default_factory=dict, repr=False)  # the checkpoint's vision_config, as read
    start_token_id: int | None = None  # before an image's placeholders (Qwen: vision_start, Gemma: boi)
    end_token_id: int | None = None  # after them (Qwen: vision_end, Gemma: eoi)
    tokens_per_image: int = 0  # Gemma 3: fixed; 0 where it follows the image's size
    spatial_merge_size: int = 1  # patches merged into one embedding along each side (Qwen, Pixtral)
    bidirectional: bool = False  # Gemma: an image's tokens attend to each other both ways
    mrope_section: tuple[int, ...] | None = None  # Qwen: rotary frequencies per position stream (t, h, w)
    # Mistral3: the projector's top-level keys (vision_feature_layer, projector_hidden_act, multimodal_projector_bias)
    projector: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_deepstack(self) -> int:
        """Qwen3-VL's DeepStack: sets of embeddings beyond the main one that each image becomes (0 elsewhere)."""
        return len(self.tower.get("deepstack_visual_indexes") or ())

    @property
    def patch_size(self) -> int:
        size = self.tower.get("patch_size", 14)
        return int(size[0] if isinstance(size, (list, tuple)) else size)


def parse_vision_config(hf: dict[str, Any], architecture: str) -> VisionConfig | None:
    """The checkpoint's vision description, or None for an architecture that takes no images."""
    kind = VISION_KINDS.get(architecture)
    if kind is None or "vision_config" not in hf:
        return None
    tower = dict(hf.get("vision_config") or {})
    text = hf.get("text_config") or {}
    if kind == "qwen3_5":
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        return VisionConfig(kind, int(hf.get("image_token_id", 248_056)), tower,
                            start_token_id=hf.get("vision_start_token_id", 248_053),
                            end_token_id=hf.get("vision_end_token_id", 248_054),
                            spatial_merge_size=int(tower.get("spatial_merge_size", 2)),
                            mrope_section=tuple(rope.get("mrope_section") or (11, 11, 10)))
    if kind == "gemma3":
        return VisionConfig(kind, int(hf.get("image_token_index", 262_144)), tower,
                            start_token_id=hf.get("boi_token_index", 255_999),
                            end_token_id=hf.get("eoi_token_index", 256_000),
                            tokens_per_image=int(hf.get("mm_tokens_per_image", 256)), bidirectional=True)
    if kind == "pixtral":
        keys = ("vision_feature_layer", "projector_hidden_act", "multimodal_projector_bias")
        return VisionConfig(kind, int(hf.get("image_token_index", 10)), tower,
                            spatial_merge_size=int(hf.get("spatial_merge_size", 2)),
                            projector={k: hf[k] for k in keys if k in hf})
    return VisionConfig(kind, int(hf.get("image_token_id", 258_880)), tower,
                        start_token_id=hf.get("boi_token_id"), end_token_id=hf.get("eoi_token_id"),
                        bidirectional=text.get("use_bidirectional_attention") == "vision")  # HF's switch
