"""Tiny random-weight vision-language checkpoints for the image tests, with working processors, and HF's greedy
generation on the same processor outputs (the oracle).

`make_tiny_vl_model(tmp, arch)` (Qwen3.5 dense/MoE, Qwen3-VL), `make_tiny_gemma3_vl`, `make_tiny_gemma4_vl` and
`make_tiny_mistral3_vl` write a folder as the hub has it: config.json with a small vision tower, the
weights of transformers' own image-text-to-text model, a tokenizer that knows the family's image tokens, a chat
template that writes the family's placeholder for an image part, and the image processor's config (small
min/max pixels, so an image is a few dozen tokens). `hf_greedy_mm` runs HF `generate` on a MultiModalInputs
(ids, pixels, grids) the engine's own processor made, with the image arguments of `hf_mm_kwargs` (also what a
teacher-forced forward over prompt and reply takes).
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

from tiny_models import ARCHS, HYBRID, HYBRID_MOE, ROUTER_WEIGHTS, _tokenizer

QWEN_IMAGE_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# mRoPE over half of each 16-dim head: four frequencies, one per stream (t, h, w) and t again.
QWEN_VL_TEXT = dict(HYBRID, partial_rotary_factor=0.5, rope_parameters={
    "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
    "mrope_interleaved": True})
QWEN_VL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, out_hidden_size=64,
                      num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)
# Qwen3-VL: a Qwen3 text model, interleaved mRoPE over the whole 16-dim head (eight frequencies: t h w t h w t t).
QWEN3_VL_TEXT = dict(head_dim=16, num_hidden_layers=3, tie_word_embeddings=False, rope_parameters={
    "rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True})
VL_FAMILIES = {
    "qwen3_5-vl": ("qwen3_5", dict(QWEN_VL_TEXT)),
    "qwen3_5_moe-vl": ("qwen3_5_moe", dict(QWEN_VL_TEXT, **HYBRID_MOE)),
    "qwen3_vl": ("qwen3_vl", dict(QWEN3_VL_TEXT)),
    # 24-wide experts: 2 x 24 != 64 hidden, so a fused gate_up tensor's layout is never ambiguous
    "qwen3_vl_moe": ("qwen3_vl_moe", dict(QWEN3_VL_TEXT, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=24)),
}
# Both tower blocks feed the first two decoder layers.
DEEPSTACK = {"qwen3_vl": dict(deepstack_visual_indexes=[0, 1]), "qwen3_vl_moe": dict(deepstack_visual_indexes=[0, 1])}
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 2, 28 * 28 * 16  # 2 to 16 merged tokens per image


def make_tiny_vl_model(tmp_dir: str | Path, arch: str = "qwen3_5-vl", seed: int = 0) -> Path:
    import transformers
    from transformers import GenerationConfig

    model_type, text = VL_FAMILIES[arch]
    tokenizer = copy.deepcopy(_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"] + QWEN_IMAGE_TOKENS})
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(QWEN_IMAGE_TOKENS)))
    text = dict(text, vocab_size=len(tokenizer) + 12, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    vision = dict(QWEN_VL_VISION, **DEEPSTACK.get(model_type, {}))
    config = transformers.AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                               tie_word_embeddings=False, **ids)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # HF init leaves biases zero and norms one; randomize them so they matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(ROUTER_WEIGHTS):
                p.copy_(torch.randn_like(p))
            elif "visual" in name:  # a tower at HF's init barely moves its output: make images matter
                p.mul_(4.0)
    path = Path(tmp_dir) / f"tiny-{arch}"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    image_processor().save_pretrained(path)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return path


GEMMA3_IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA3_VL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# SigLIP at 56 x 56 pixels in 14-pixel patches: a 4 x 4 grid pooled 2 x 2 into 4 tokens per image.
GEMMA3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                     patch_size=14, vision_use_head=False)


def make_tiny_gemma3_vl(tmp_dir: str | Path, seed: int = 0) -> Path:
    """Gemma 3 with a SigLIP tower and projector, its PIL image processor and the image tokens in the vocabulary."""
    import transformers
    from transformers import GenerationConfig, Gemma3ImageProcessorPil

    from tiny_models import GEMMA3_TEXT
    tokenizer = copy.deepcopy(_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]
                                  + GEMMA3_IMAGE_TOKENS})
    tokenizer.chat_template = GEMMA3_VL_TEMPLATE
    boi, eoi, image = tokenizer.convert_tokens_to_ids(GEMMA3_IMAGE_TOKENS)
    text = dict(GEMMA3_TEXT, vocab_size=len(tokenizer) + 12, hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("gemma3", text_config=text, vision_config=dict(GEMMA3_VISION),
                                               mm_tokens_per_image=4, boi_token_index=boi, eoi_token_index=eoi,
                                               image_token_index=image)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "projection_weight" in name:  # zeros at HF's init: the image would be all zeros
                p.copy_(torch.randn_like(p))
            elif "vision_tower" in name:
                p.mul_(4.0)
    path = Path(tmp_dir) / "tiny-gemma3-vl"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(path)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return path


PIXTRAL_IMAGE_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# Pixtral in 14-pixel patches merged 2 x 2, images resized to at most 112 pixels a side: up to 4 x 4 embeddings.
PIXTRAL_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                      image_size=112, patch_size=14, hidden_act="silu")


def make_tiny_mistral3_vl(tmp_dir: str | Path, seed: int = 0) -> Path:
    """Mistral3 with a Pixtral tower and projector, its PIL image processor and Pixtral's image tokens."""
    import transformers
    from transformers import GenerationConfig, PixtralImageProcessorPil

    tokenizer = copy.deepcopy(_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"] + PIXTRAL_IMAGE_TOKENS})
    image, _, _ = tokenizer.convert_tokens_to_ids(PIXTRAL_IMAGE_TOKENS)
    text = dict(model_type="mistral", head_dim=16, sliding_window=None, vocab_size=len(tokenizer) + 12,
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("mistral3", text_config=text, vision_config=dict(PIXTRAL_VISION),
                                               image_token_index=image, spatial_merge_size=2,
                                               tie_word_embeddings=False)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "vision_tower" in name or "projector" in name:
                p.mul_(4.0)
    path = Path(tmp_dir) / "tiny-mistral3-vl"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    PixtralImageProcessorPil(patch_size=14, size={"longest_edge": 112}).save_pretrained(path)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return path


def image_processor():
    """Qwen's image processor at test sizes (the PIL one: this machine has no torchvision)."""
    from transformers import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def random_image(width: int, height: int, seed: int = 0):
    """A random RGB PIL image."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_mm_kwargs(model, items, ids: torch.Tensor) -> dict:
    """HF's image arguments for `ids` [1, T] holding `items`' placeholders: the pixels and grids of every image, and
    the token types over `ids` where the family reads them (Qwen's mRoPE, Gemma's both-ways mask)."""
    if not items:
        return {}
    kwargs, image_token = {}, model.config.image_token_id
    if "image_position_ids" in items[0].data:  # Gemma 4: padded patches, their positions, token types
        return dict(pixel_values=torch.cat([item.data["pixel_values"] for item in items]),
                    image_position_ids=torch.cat([item.data["image_position_ids"] for item in items]),
                    mm_token_type_ids=(ids == image_token).long())
    if "image_sizes" not in items[0].data:
        kwargs["pixel_values"] = torch.cat([item.data["pixel_values"] for item in items])
    if "image_grid_thw" in items[0].data:  # Qwen
        kwargs["image_grid_thw"] = torch.cat([item.data["image_grid_thw"] for item in items])
        kwargs["mm_token_type_ids"] = (ids == image_token).int()
    elif "image_sizes" in items[0].data:  # Pixtral: images padded to the largest (HF's batch)
        pixels = [item.data["pixel_values"] for item in items]
        height, width = max(p.shape[-2] for p in pixels), max(p.shape[-1] for p in pixels)
        kwargs["pixel_values"] = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1], 0,
                                                                        height - p.shape[-2])) for p in pixels])
        kwargs["image_sizes"] = torch.cat([item.data["image_sizes"] for item in items])
    else:  # Gemma 3: the token types make an image's tokens see each other both ways
        kwargs["token_type_ids"] = (ids == image_token).long()
    return kwargs


def hf_greedy_mm(model, inputs, max_tokens: int) -> list[int]:
    """HF generate on the engine processor's outputs: the expanded ids, the pixels and grids of every image."""
    ids = torch.tensor([inputs.prompt_token_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             **hf_mm_kwargs(model, inputs.items, ids))
    return out[0, ids.shape[1]:].tolist()


GEMMA4_IMAGE_TOKENS = ["<|image>", "<image|>", "<|image|>"]  # begin, end, soft token (Gemma 4's own spellings)
# 4-pixel patches pooled 3 x 3: an image becomes at most 70 soft tokens (the processor's smallest budget).
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=256,
              standardize=True)


def make_tiny_gemma4_vl(tmp_dir: str | Path, seed: int = 0, bidirectional: str | None = "vision",
                        clipped: bool = False) -> Path:
    """Gemma 4 (E2B-shaped text model) with a vision tower and `embed_vision`, its PIL image processor and the
    image tokens in the vocabulary; no audio tower. `clipped`: every tower projection clamps its input and output
    to finite random bounds that bite."""
    import transformers
    from transformers import GenerationConfig, Gemma4ImageProcessorPil

    tokenizer = copy.deepcopy(_tokenizer())
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"] + GEMMA4_IMAGE_TOKENS})
    boi, eoi, image = tokenizer.convert_tokens_to_ids(GEMMA4_IMAGE_TOKENS)
    text = dict(ARCHS["gemma4"][2], vocab_size=len(tokenizer) + 12, hidden_size=64, intermediate_size=128,
                num_attention_heads=4, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6,
                use_bidirectional_attention=bidirectional, num_hidden_layers=6,
                layer_types=["sliding_attention", "full_attention"] * 3)
    text["vocab_size_per_layer_input"] = text["vocab_size"]
    torch.manual_seed(seed)
    vision = dict(GEMMA4_VISION, use_clipped_linears=clipped)
    config = transformers.AutoConfig.for_model("gemma4", text_config=text, vision_config=vision,
                                               boi_token_id=boi, eoi_token_id=eoi, image_token_id=image,
                                               video_token_id=image + 1000, audio_token_id=image + 1001)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # HF init leaves norms one and the standardizing buffers empty; make them matter
        for name, p in model.named_parameters():
            if "norm" in name or "layer_scalar" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "vision" in name:
                p.mul_(4.0)
        tower = model.model.vision_tower
        tower.std_bias.copy_(torch.randn_like(tower.std_bias) * 0.1)
        tower.std_scale.copy_(1 + torch.randn_like(tower.std_scale) * 0.1)
        for name, buffer in tower.named_buffers():
            if name.rsplit(".", 1)[-1] in ("input_min", "input_max", "output_min", "output_max"):
                sign = -1.0 if name.endswith("min") else 1.0
                buffer.fill_(sign * (0.5 + torch.rand(()).item()))
    path = Path(tmp_dir) / "tiny-gemma4-vl"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=3, max_soft_tokens=70).save_pretrained(path)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return path
