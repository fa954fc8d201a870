"""What a vision-language model's image side takes on each card: the tower's and projector's parameters (replicated
on every rank and kept in the model's float dtype, as engine/models/vision.py loads them) and the tower's peak
activations and encoder cache for the largest image an accepted one becomes (the processor's own largest after
--mm-processor-kwargs resize it, within --max-image-pixels: `largest_image_embeds`, the one rule the engine's
processor, its sizing and profile image and the planners follow). Counted from the checkpoint's vision_config (ModelConfig.vision), family by family, exactly
as the engine's tower modules are built. Torch-free: the GUI's planner imports it.
"""
from __future__ import annotations

import math

from engine.config.mm_processor import hf_processor_kwargs, processor_max_embeds
from engine.config.model import ModelConfig
from engine.config.vision import VisionConfig


def _encoder_layer_params(hidden: int, intermediate: int) -> int:
    """A pre-norm transformer layer with biases everywhere: two LayerNorms, q/k/v/o, a two-matrix MLP."""
    return 4 * hidden + 4 * (hidden * hidden + hidden) + 2 * hidden * intermediate + intermediate + hidden


def tower_params(vision: VisionConfig, text_hidden: int) -> int:
    """Parameters of the tower and projector (what `encode_image` reads), 0 for a family without a tower here."""
    t = vision.tower
    hidden, channels = int(t.get("hidden_size", 1152)), int(t.get("in_channels", t.get("num_channels", 3)))
    if vision.kind == "qwen3_5":
        patch, temporal = int(t.get("patch_size", 16)), int(t.get("temporal_patch_size", 2))
        merged = hidden * vision.spatial_merge_size ** 2
        layers = int(t.get("depth", 27)) * _encoder_layer_params(hidden, int(t.get("intermediate_size", 4304)))
        projection = merged * merged + merged + merged * int(t.get("out_hidden_size", 3584)) + int(
            t.get("out_hidden_size", 3584))
        mergers = 2 * hidden + projection + vision.num_deepstack * (2 * merged + projection)  # Qwen3-VL's DeepStack
        return (hidden * channels * temporal * patch * patch + hidden + int(t.get("num_position_embeddings", 2304))
                * hidden + layers + mergers)
    if vision.kind == "gemma3":
        patch, side = int(t.get("patch_size", 14)), int(t.get("image_size", 896))
        layers = int(t.get("num_hidden_layers", 27)) * _encoder_layer_params(hidden, int(t.get("intermediate_size", 4304)))
        embeddings = hidden * channels * patch * patch + hidden + (side // patch) ** 2 * hidden
        return embeddings + layers + 2 * hidden + hidden * text_hidden + hidden
    if vision.kind == "pixtral":
        patch, intermediate = int(t.get("patch_size", 16)), int(t.get("intermediate_size", 4096))
        layer = 2 * hidden + 4 * hidden * hidden + 3 * hidden * intermediate  # RMSNorms, q/k/v/o, gated MLP
        bias = text_hidden if vision.projector.get("multimodal_projector_bias") else 0
        projector = (hidden + hidden * vision.spatial_merge_size ** 2 * hidden + hidden * text_hidden
                     + text_hidden * text_hidden + 2 * bias)
        return hidden * channels * patch * patch + hidden + int(t.get("num_hidden_layers", 24)) * layer + projector
    if vision.kind == "gemma4":
        return _gemma4_tower_params(t, hidden, text_hidden)
    return 0


def _gemma4_tower_params(t: dict, hidden: int, text_hidden: int) -> int:
    """Gemma 4's tower (engine/models/gemma4_vision.py): bias-free projections, four RMSNorms and q/k norms per
    layer, four clamp bounds per checkpoint projection where it clips, the x/y position tables, the
    standardizing pair, and embed_vision's projection."""
    heads = int(t.get("num_attention_heads", 12))
    kv_heads, head_dim = int(t.get("num_key_value_heads", heads)), int(t.get("head_dim") or hidden // heads)
    patch, intermediate = int(t.get("patch_size", 16)), int(t.get("intermediate_size", 3072))
    clamps = 4 * 7 if t.get("use_clipped_linears") else 0  # q, k, v, o, gate, up, down
    layer = (4 * hidden + 2 * head_dim + hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
             + 3 * hidden * intermediate + clamps)
    embedder = int(t.get("output_proj_dims") or hidden) * text_hidden
    return (3 * patch * patch * hidden + 2 * int(t.get("position_embedding_size", 10 * 1024)) * hidden
            + int(t.get("num_hidden_layers", 16)) * layer + (2 * hidden if t.get("standardize") else 0) + embedder)


def tower_patches(vision: VisionConfig, max_embeds: int) -> int:
    """Patches the tower runs for the largest image: Gemma 3's fixed square; Qwen's embeddings times the merge."""
    t = vision.tower
    if vision.kind == "gemma3":
        return (int(t.get("image_size", 896)) // int(t.get("patch_size", 14))) ** 2
    if vision.kind == "gemma4":  # each soft token pools a k x k cell of patches
        return max_embeds * int(t.get("pooling_kernel_size", 3)) ** 2
    return max_embeds * vision.spatial_merge_size ** 2


def default_max_embeds(vision: VisionConfig) -> int:
    """The most embeddings one image becomes under the family's published processor settings, for a planner
    without the folder (the engine asks the folder's processor: MultiModalProcessor.max_embeds_per_image):
    Gemma 3's fixed count; Gemma 4's 280 soft tokens; Pixtral's image_size square; Qwen's longest_edge of 16,777,216 pixels over (patch x merge)² = 32² pixels."""
    if vision.kind == "gemma3":
        return vision.tokens_per_image
    if vision.kind == "gemma4":  # the image processor's default max_soft_tokens
        return 280
    if vision.kind == "pixtral":  # the tower's image_size is the processor's longest edge
        side = int(vision.tower.get("image_size", 1540)) // (vision.patch_size * vision.spatial_merge_size)
        return side * side
    unit = int(vision.tower.get("patch_size", 16)) * vision.spatial_merge_size
    return 16_777_216 // (unit * unit)


def largest_image_embeds(vision: VisionConfig, max_image_pixels: int | None,
                         processor_embeds: int | None = None, processor_kwargs: dict | None = None) -> int:
    """The most embeddings one accepted image becomes: the processor's own largest (`processor_embeds`, which the
    engine asks its folder's processor for, built with --mm-processor-kwargs; else the family's published default
    as `processor_kwargs` resize it), and where the count follows the image's size (Qwen, Pixtral) no more than
    the largest image --max-image-pixels admits becomes. The encoder budget, the encoder cache, the tower's
    planned peak and the profile image all follow from it. Gemma 3's count is fixed and Gemma 4's processor
    resizes every image to its soft-token budget: the cap changes neither."""
    if processor_embeds is not None:
        largest = processor_embeds
    else:
        kwargs = processor_kwargs or {}
        hf_processor_kwargs(vision, kwargs)  # an unknown key is refused by name, as at the engine's start
        largest = processor_max_embeds(vision, kwargs, default_max_embeds(vision))
    if max_image_pixels is None or vision.kind not in ("qwen3_5", "pixtral"):
        return largest
    return min(largest, largest_image_within(vision, max_image_pixels)[0])


def largest_image_within(vision: VisionConfig, max_pixels: int) -> tuple[int, int, int]:
    """(embeddings, height, width) of the image of at most `max_pixels` pixels that becomes the most embeddings
    before the processor's own limit (Qwen, Pixtral), over every shape: a thin image rounds up more than a
    square. Qwen rounds each side to patch x merge and refuses beyond 200:1; Pixtral shrinks the longest side to
    its image_size, pads each side to whole patches and merges them merge x merge. A Qwen side under half a unit
    rounds to nothing and the processor scales such a strip up to its own minimum instead (65,536 pixels, 64
    embeddings: far inside any step's budget), so those shapes are left out. The startup profile encodes this
    shape when the cap binds."""
    best = (0, 0, 0)
    if vision.kind == "qwen3_5":
        unit = int(vision.tower.get("patch_size", 16)) * vision.spatial_merge_size
        for short in range(unit // 2 + 1, math.isqrt(max_pixels) + 1):
            long = min(max_pixels // short, 200 * short)
            best = max(best, (round(short / unit) * round(long / unit), short, long))
        return best
    patch, merge, edge = vision.patch_size, vision.spatial_merge_size, int(vision.tower.get("image_size", 1540))
    for short in range(1, math.isqrt(max_pixels) + 1):
        long = max_pixels // short
        ratio = max(1.0, long / edge)
        embeds = (math.ceil(math.floor(short / ratio) / patch) // merge) * (
            math.ceil(math.floor(long / ratio) / patch) // merge)
        best = max(best, (embeds, short, long))
    return best


def tower_activation_bytes(vision: VisionConfig, max_embeds: int, dtype_bytes: int,
                           materialized_scores: bool = False) -> int:
    """The tower's peak working memory for one image of `max_embeds` embeddings: the residual stream, its norm,
    the q/k/v and the MLP's hidden of one layer; with `materialized_scores` (SDPA's math path, the CPU's) every
    head's float32 attention scores too — CUDA's fused kernels never hold them."""
    t = vision.tower
    n = tower_patches(vision, max_embeds)
    hidden = int(t.get("hidden_size", 1152))
    heads = int(t.get("num_heads", t.get("num_attention_heads", 16)))
    activations = n * (5 * hidden + int(t.get("intermediate_size", 4304))) * dtype_bytes
    return activations + (heads * n * n * 4 if materialized_scores else 0)


def encoder_budget(max_num_batched_tokens: int, max_embeds: int) -> int:
    """Embeddings one step may encode (vLLM's encoder budget): the step's token budget, and at least the largest
    image, so every image the processor makes can be encoded in some step."""
    return max(max_num_batched_tokens, max_embeds)


def encoder_cache_capacity(max_num_batched_tokens: int, max_embeds: int) -> int:
    """Embeddings the encoder cache holds: two steps' budgets (the image a prompt is consuming and the next)."""
    return 2 * encoder_budget(max_num_batched_tokens, max_embeds)


def encoder_cache_bytes(cfg: ModelConfig, max_num_batched_tokens: int, dtype_bytes: int,
                        max_embeds: int | None = None) -> int:
    """The encoder cache at its fullest on every card (each rank keeps the embeddings it encoded): its capacity
    in text-width vectors of the model's dtype (Qwen3-VL: one more per DeepStack layer), as
    engine/worker/encoder_runner.py keeps them. `max_embeds`: the
    folder's processor's largest image (the engine asks it), else the family's published default; 0 for a
    model served as text. The KV sizing and the planner both set it aside before the KV cache."""
    if cfg.vision is None:
        return 0
    largest = default_max_embeds(cfg.vision) if max_embeds is None else max_embeds
    width = cfg.hidden_size * (1 + cfg.vision.num_deepstack)  # Qwen3-VL keeps DeepStack's embeddings beside them
    return encoder_cache_capacity(max_num_batched_tokens, largest) * width * dtype_bytes


def tower_peak_over_forward(cfg: ModelConfig, forward_bytes: int, dtype_bytes: int,
                            max_embeds: int | None = None) -> int:
    """What the tower adds to a step's peak: it runs before the forward and frees its working memory first, so only
    the part of its peak at the largest image (`max_embeds`, else the family's published default) above the
    forward's own; 0 for a text model."""
    if cfg.vision is None:
        return 0
    largest = default_max_embeds(cfg.vision) if max_embeds is None else max_embeds
    return max(0, tower_activation_bytes(cfg.vision, largest, dtype_bytes) - forward_bytes)


def vision_weights_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """The image side's weights on every card (replicated), 0 for a text model or a VL folder served as text."""
    return 0 if cfg.vision is None else tower_params(cfg.vision, cfg.hidden_size) * dtype_bytes
