"""Qwen3-VL (dense), what only it has beside the shared tests (tests/test_images_families.py's qwen3_vl row: HF
parity for one image, two images and an odd size, chunked prefill cutting an image, prefix caching, forced
preemption, n > 1, TP=2): the tower's DeepStack sets ride beside the main embeddings and the planner counts their
mergers and cache; Qwen3-VL-MoE is refused by name."""
from __future__ import annotations

import pytest

from engine.config.model import ModelConfig
from engine.planning.vision import encoder_cache_bytes, tower_params

pytest.importorskip("PIL")


def test_deepstack_rides_beside_the_embeddings_and_is_counted(image_family):
    built = image_family("qwen3_vl")
    model, cfg, item = built.llm.engine.runner.model, ModelConfig.from_folder(built.path), built.cases[0].items[0]
    embeds = model.encode_image(item.data)
    assert cfg.vision.num_deepstack == 2 and embeds.shape == (item.num_embeds, 3 * cfg.hidden_size)
    assert embeds[:, cfg.hidden_size:].abs().sum() > 0
    tower = sum(p.numel() for name, p in model.named_parameters() if name.startswith("visual."))
    assert tower_params(cfg.vision, cfg.hidden_size) == tower
    assert encoder_cache_bytes(cfg, 64, 4, 16) == 2 * 64 * 3 * cfg.hidden_size * 4


def test_qwen3_vl_moe_is_refused_by_name():
    from engine.models.registry import get_architecture
    with pytest.raises(ValueError, match="Qwen3-VL-MoE is not built: .*fused 3-D tensors"):
        get_architecture("Qwen3VLMoeForConditionalGeneration")
