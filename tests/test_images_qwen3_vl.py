"""Qwen3-VL (dense), what only it has beside the shared tests (tests/test_images_families.py's qwen3_vl row: HF
parity for one image, two images and an odd size, chunked prefill cutting an image, prefix caching, forced
preemption, n > 1, TP=2; Qwen3-VL-MoE is a row too): the tower's DeepStack sets ride beside the main embeddings and
the planner counts their mergers and cache; Qwen3-VL-MoE's fused experts load in the hub's layout and in
transformers 5's."""
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


def test_fused_experts_load_in_either_layout():
    """Qwen3-VL-MoE's stacked experts: transformers 5's saved layout ([E, 2I, H], [E, H, I]; the tiny checkpoint's)
    and the hub's transposed one give the same per-projection tensors; a shape that fits neither is an error."""
    import torch

    from engine.models.qwen3_vl import split_fused_experts
    gate_up, down = torch.randn(4, 2 * 24, 64), torch.randn(4, 64, 24)
    saved = [("m.experts.gate_up_proj", gate_up), ("m.experts.down_proj", down), ("m.gate.weight", torch.ones(1))]
    hub = [("m.experts.gate_up_proj", gate_up.transpose(1, 2)), ("m.experts.down_proj", down.transpose(1, 2)),
           ("m.gate.weight", torch.ones(1))]
    a, b = dict(split_fused_experts(saved, 64, 24)), dict(split_fused_experts(hub, 64, 24))
    assert sorted(a) == ["m.experts.down_proj.weight", "m.experts.gate_proj.weight", "m.experts.up_proj.weight",
                         "m.gate.weight"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["m.experts.up_proj.weight"], gate_up[:, 24:])
    with pytest.raises(ValueError, match="neither"):
        list(split_fused_experts([("m.experts.down_proj", torch.randn(4, 64, 23))], 64, 24))
