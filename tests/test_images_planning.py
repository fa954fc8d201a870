"""The planner counts a VL model's image side: the tower's and projector's weights exactly as loaded (every card
holds them whole), and the tower's working memory at the largest image where it tops the forward's; a VL folder
without its image processor is served as text and counts none of it."""
from __future__ import annotations

import json

import pytest

from engine.config.model import ModelConfig
from engine.models.registry import model_class
from engine.planning.activations import estimate_activation_bytes
from engine.planning.vision import default_max_embeds, tower_params
from engine.planning.weights import weights_bytes_per_card
from engine.worker.loader import iterate_weights
from tiny_vl_models import make_tiny_gemma3_vl, make_tiny_mistral3_vl, make_tiny_vl_model

pytest.importorskip("PIL")
TOWER_PREFIXES = ("visual.", "vision_tower.", "multi_modal_projector.")


@pytest.fixture(scope="module", params=["qwen3_5-vl", "qwen3_5_moe-vl", "gemma3-vl", "mistral3-vl"])
def vl_folder(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    makers = {"gemma3-vl": make_tiny_gemma3_vl, "mistral3-vl": make_tiny_mistral3_vl}
    return makers[request.param](tmp) if request.param in makers else make_tiny_vl_model(tmp, request.param)


def test_weights_count_the_tower_exactly_as_loaded(vl_folder):
    cfg = ModelConfig.from_folder(vl_folder)
    model = model_class(cfg.architecture)(cfg)
    model.load_weights(iterate_weights(vl_folder))
    tower = sum(p.numel() for name, p in model.named_parameters() if name.startswith(TOWER_PREFIXES))
    assert tower and tower_params(cfg.vision, cfg.hidden_size) == tower
    assert weights_bytes_per_card(cfg, 4) == sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights_bytes_per_card(cfg, 4, tp=2) < weights_bytes_per_card(cfg, 4)  # the text model still splits


def test_a_folder_without_its_image_processor_counts_no_tower(vl_folder, tmp_path):
    cfg = ModelConfig.from_folder(vl_folder)
    text_only = tmp_path / "text-only"
    text_only.mkdir()
    (text_only / "config.json").write_text((vl_folder / "config.json").read_text())
    served_as_text = ModelConfig.from_folder(text_only)
    assert served_as_text.vision is None
    assert weights_bytes_per_card(cfg, 2) - weights_bytes_per_card(served_as_text, 2) == \
        tower_params(cfg.vision, cfg.hidden_size) * 2
    assert estimate_activation_bytes(cfg, 1, 2) > estimate_activation_bytes(served_as_text, 1, 2)  # the tower's peak


def test_published_gemma3_27b_counts_its_siglip_tower():
    from test_model_families import GEMMA3_27B
    cfg = ModelConfig.from_hf_config(json.loads(json.dumps(GEMMA3_27B)))
    assert default_max_embeds(cfg.vision) == 256
    # SigLIP-So400m (27 layers of 1152, 4304) with its 4096 patch positions, and the 1152 x 5376 projection
    assert 400e6 < tower_params(cfg.vision, cfg.hidden_size) < 425e6


def test_the_router_places_a_vl_replica_with_its_encoder_cache(vl_folder):
    """The router's placement sets a VL replica's encoder cache aside as the engine's sizing does, sized by
    --max-image-pixels through the planner's rule; '{"image": 0}' places it as text."""
    from engine.entrypoints.router.placement import Card, replica_need
    from engine.entrypoints.router.specs import ModelSpec
    from engine.config.model import DTYPE_BYTES
    from engine.planning.units import GIB, resolve_dtype
    from engine.planning.vision import encoder_cache_bytes, largest_image_embeds
    card, flags = Card(0, "cuda:0", 64 * GIB), {"max_model_len": 256, "enforce_eager": True, "max_num_seqs": 2}
    need, text = (replica_need(ModelSpec("v", str(vl_folder), {**flags, **extra}), card, None)
                  for extra in ({}, {"limit_mm_per_prompt": '{"image": 0}'}))
    cfg = ModelConfig.from_folder(vl_folder)
    config = ModelSpec("v", str(vl_folder), flags).engine_config()
    step, dtype_bytes = config.resolve_max_num_batched_tokens(256), DTYPE_BYTES[resolve_dtype(config.dtype,
                                                                                              cfg.torch_dtype, True)]
    cache = encoder_cache_bytes(cfg, step, dtype_bytes, largest_image_embeds(cfg.vision, config.max_image_pixels))
    assert need.overhead_bytes - text.overhead_bytes == cache > 0
    assert need.weights_bytes > text.weights_bytes  # the tower, replicated
