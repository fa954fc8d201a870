"""--mm-processor-kwargs resizes, --max-image-pixels refuses: an image above the processor's resize target but within
the refusal limit is accepted and becomes what HF's own processor makes of it with the same kwargs (placeholders and
greedy ids); one above --max-image-pixels is still refused naming its part; an unknown key is refused at the start by
name; and the largest image the rule sizes the encoder for follows the kwargs, the engine's and the planners' alike."""
from __future__ import annotations

import dataclasses
import json

import pytest

from engine import LLM, SamplingParams
from engine.config.flags import DEFAULT_MAX_IMAGE_PIXELS, EngineConfig
from engine.config.mm_processor import hf_processor_kwargs
from engine.config.model import ModelConfig
from engine.planning.planner import plan_capacity
from engine.planning.units import GIB
from engine.planning.vision import encoder_cache_bytes, largest_image_embeds
from image_families import qwen_prompt as prompt
from tiny_models import hf_model
from tiny_vl_models import hf_greedy_mm, make_tiny_mistral3_vl, make_tiny_vl_model, random_image

pytest.importorskip("PIL")

KWARGS = {"max_pixels": 28 * 28 * 6}  # the tiny processor's own largest is 28·28·16 pixels (16 embeddings)


@pytest.fixture(scope="module")
def resized(tmp_path_factory):
    path = make_tiny_vl_model(tmp_path_factory.mktemp("qwen-resize"), "qwen3_5-vl")
    return LLM(str(path), device="cpu", max_num_seqs=2, max_num_batched_tokens=64,
               mm_processor_kwargs=json.dumps(KWARGS), max_image_pixels=200 * 200)


def test_the_refusal_limit_is_an_8k_frame_by_default():
    assert DEFAULT_MAX_IMAGE_PIXELS == EngineConfig().max_image_pixels == 7680 * 4320
    assert EngineConfig().processor_kwargs() == {}  # the processor's own largest image, as vLLM
    with pytest.raises(ValueError, match="--mm-processor-kwargs must be"):
        EngineConfig(mm_processor_kwargs="max_pixels=5").validate()


def test_a_large_image_is_resized_as_hfs_processor_does(resized):
    from transformers import AutoImageProcessor
    engine, image = resized.engine, random_image(150, 120, 3)  # 18,000 pixels: above 4,704, within 40,000
    text = prompt("Describe this.", 1)
    mm = engine.images.process(text, [image])
    hf_grid = AutoImageProcessor.from_pretrained(str(engine.model_path), **KWARGS)(
        images=[image], return_tensors="pt")["image_grid_thw"]
    own_grid = AutoImageProcessor.from_pretrained(str(engine.model_path))(images=[image],
                                                                          return_tensors="pt")["image_grid_thw"]
    assert mm.items[0].num_embeds == int(hf_grid.prod()) // 4 <= engine.images.max_embeds == 6
    assert int(own_grid.prod()) // 4 > engine.images.max_embeds  # without the kwargs it would not fit the budget
    params = SamplingParams(temperature=0, max_tokens=6)
    out = resized.generate({"prompt": text, "multi_modal_data": {"image": image}}, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy_mm(hf_model(engine.model_path), mm, 6)


def test_above_the_refusal_limit_is_still_refused_naming_the_part(resized):
    with pytest.raises(ValueError, match=r"image 0 is 250x200 = 50000 pixels.*--max-image-pixels"):
        resized.engine.images.process(prompt("Describe this.", 1), [random_image(250, 200)])


def test_an_unknown_key_is_refused_at_the_start_by_name(resized):
    engine = resized.engine
    with pytest.raises(ValueError, match=r"\['max_pixel'\].*accepts \['max_pixels', 'min_pixels'\]"):
        LLM(str(engine.model_path), device="cpu", max_num_seqs=2, max_num_batched_tokens=64,
            mm_processor_kwargs='{"max_pixel": 4704}')
    from test_model_families import GEMMA3_27B
    gemma3 = ModelConfig.from_hf_config(json.loads(json.dumps(GEMMA3_27B))).vision
    with pytest.raises(ValueError, match=r"\['max_pixels'\].*accepts \[\].*fixed square"):
        hf_processor_kwargs(gemma3, {"max_pixels": 1_000_000})
    with pytest.raises(ValueError, match="max_soft_tokens must be one of"):
        hf_processor_kwargs(dataclasses.replace(gemma3, kind="gemma4"), {"max_soft_tokens": 100})


def test_the_budget_follows_the_kwargs_in_the_engine_and_the_planners(resized, tmp_path):
    from app.capacity import plan_for
    from engine.core.tokenizer import load_tokenizer
    from engine.multimodal.processor import MultiModalProcessor, profile_pixels
    engine = resized.engine
    vision = engine.model_config.vision
    assert engine.images.max_embeds == largest_image_embeds(vision, 200 * 200, processor_kwargs=KWARGS) == 6
    assert engine.images.encoder_cache.capacity == 2 * 64  # two steps' budgets: the image is below the step
    assert int(profile_pixels(engine.images.largest_image())["image_grid_thw"].prod()) // 4 <= 6
    # Pixtral: its longest edge, the engine's processor and the rule agree.
    path = make_tiny_mistral3_vl(tmp_path / "pixtral")
    pixtral = ModelConfig.from_folder(path).vision
    processor = MultiModalProcessor(path, pixtral, load_tokenizer(str(path)), None, {"longest_edge": 56})
    assert processor.max_embeds_per_image() == largest_image_embeds(
        pixtral, None, processor_kwargs={"longest_edge": 56}) == 4 < 16
    # Gemma 4: its soft-token budget, the engine's processor and the rule agree.
    from tiny_vl_models import make_tiny_gemma4_vl
    path = make_tiny_gemma4_vl(tmp_path / "gemma4")
    gemma4 = ModelConfig.from_folder(path).vision
    processor = MultiModalProcessor(path, gemma4, load_tokenizer(str(path)), None, {"max_soft_tokens": 140})
    assert processor.max_embeds_per_image() == largest_image_embeds(
        gemma4, None, processor_kwargs={"max_soft_tokens": 140}) == 140
    # The planners: Qwen3.6-27B resized to 1080p by the kwargs, through plan_capacity and the app's Models tab.
    from engine.bench.hybrid import QWEN3_6_27B
    qwen = ModelConfig.from_hf_config(json.loads(json.dumps(QWEN3_6_27B)))
    hd = {"max_pixels": 1920 * 1080}
    full, small = (plan_capacity(qwen, [24 * GIB], 0.9, max_num_batched_tokens=2048, max_num_seqs=4,
                                 processor_kwargs=k) for k in (None, hd))
    assert small.encoder_cache_bytes == encoder_cache_bytes(qwen, 2048, 2, 1920 * 1080 // 32 ** 2)
    assert small.encoder_cache_bytes < full.encoder_cache_bytes and small.activation_bytes < full.activation_bytes
    values = {"max_num_batched_tokens": 2048, "max_num_seqs": 4}
    app_full, app_small = (plan_for(json.loads(json.dumps(QWEN3_6_27B)), dict(values, **extra), [24 * GIB])[1]
                           for extra in ({}, {"mm_processor_kwargs": json.dumps(hd)}))
    assert app_small.encoder_cache_bytes == small.encoder_cache_bytes < app_full.encoder_cache_bytes


def test_the_router_places_a_replica_by_the_kwargs(resized):
    """The router's placement sizes a VL replica's encoder cache by the processor's largest image after
    --mm-processor-kwargs, through the planner's rule."""
    from engine.config.model import DTYPE_BYTES
    from engine.entrypoints.router.placement import Card, replica_need
    from engine.entrypoints.router.specs import ModelSpec
    from engine.planning.units import resolve_dtype
    folder = str(resized.engine.model_path)
    card, flags = Card(0, "cuda:0", 64 * GIB), {"max_model_len": 256, "enforce_eager": True, "max_num_seqs": 2}
    full, small, text = (replica_need(ModelSpec("v", folder, {**flags, **extra}), card, None) for extra in (
        {}, {"mm_processor_kwargs": json.dumps(KWARGS)}, {"limit_mm_per_prompt": '{"image": 0}'}))
    cfg = ModelConfig.from_folder(folder)
    config = ModelSpec("v", folder, flags).engine_config()
    step, dtype_bytes = config.resolve_max_num_batched_tokens(256), DTYPE_BYTES[resolve_dtype(config.dtype,
                                                                                              cfg.torch_dtype, True)]
    assert small.overhead_bytes - text.overhead_bytes == encoder_cache_bytes(cfg, step, dtype_bytes, 6)
    assert small.overhead_bytes < full.overhead_bytes
