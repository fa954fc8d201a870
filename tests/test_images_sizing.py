"""A VL model's image side in the KV sizing: the encoder cache at its fullest is set aside by one rule
(engine/planning/vision.py) that the engine's sizing and the planner both apply, so they plan the same pool; and
the startup profile runs the tower on the largest image the processor accepts, so its peak is measured."""
from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

from engine import LLM
from engine.config.flags import EngineConfig
from engine.config.model import ModelConfig
from engine.multimodal.processor import profile_pixels
from engine.planning.capacity import MemoryProfile
from engine.planning.planner import estimate_profile, plan_capacity
from engine.planning.units import GIB
from engine.planning.vision import encoder_cache_bytes
from engine.worker.kv_cache_sizing import choose_num_blocks
from tiny_vl_models import make_tiny_vl_model

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


class MeasuredExecutor:
    """A CUDA executor as choose_num_blocks sees it: what each rank's profile measured (the planner's estimate,
    which holds no encoder cache, since nothing fills it at start) and, when asked, the profile on a real runner."""

    device, dtype = torch.device("cuda"), torch.bfloat16

    def __init__(self, profiles: list[MemoryProfile], runner=None) -> None:
        self.profiles, self.runner, self.images = profiles, runner, []

    def profile_memory(self, num_tokens, max_num_seqs, kv_dtype, num_speculative_tokens=0, image=None):
        self.images.append(image)
        if self.runner is not None:
            self.runner.profile_run(num_tokens, max_num_seqs, kv_dtype, num_speculative_tokens, image)
        return self.profiles


def gemma3_27b() -> ModelConfig:
    from test_model_families import GEMMA3_27B
    return ModelConfig.from_hf_config(json.loads(json.dumps(GEMMA3_27B))).with_max_model_len(8192)


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_and_planner_set_the_same_encoder_cache_aside(tp):
    cfg, budget, seqs = gemma3_27b(), 2048, 16
    cards = [80 * GIB] * tp  # bf16 27B: an 80 GB card holds it
    planned = plan_capacity(cfg, cards, 0.9, tensor_parallel_size=tp, max_num_batched_tokens=budget,
                            max_num_seqs=seqs)
    # Gemma 3: 256 embeddings an image; the cache holds twice the step's budget of 5376-wide bf16 vectors.
    assert planned.encoder_cache_bytes == encoder_cache_bytes(cfg, budget, 2) == 2 * 2048 * 5376 * 2
    measured = [dataclasses.replace(estimate_profile(cfg, total, dtype_bytes=2, tensor_parallel_size=tp,
                                                     max_num_batched_tokens=budget, max_num_seqs=seqs),
                                    encoder_cache_bytes=0) for total in cards]
    config = EngineConfig(model="m", tensor_parallel_size=tp, gpu_memory_utilization=0.9, max_num_seqs=seqs)
    engine = choose_num_blocks(config, cfg, MeasuredExecutor(measured), torch.bfloat16, budget,
                               max_embeds_per_image=256)
    text_only = choose_num_blocks(config, cfg, MeasuredExecutor(measured), torch.bfloat16, budget)
    assert engine == planned.num_blocks > 0
    assert text_only > engine  # the same card without the cache set aside holds more blocks


@pytest.fixture(scope="module")
def qwen_llm(tmp_path_factory):
    path = make_tiny_vl_model(tmp_path_factory.mktemp("qwen-sizing"), "qwen3_5-vl")
    return LLM(str(path), device="cpu", max_num_seqs=2, max_num_batched_tokens=64)


def test_the_engine_cache_is_the_rule(qwen_llm):
    engine = qwen_llm.engine
    images = engine.images
    assert images.max_embeds == 16  # the tiny processor's 28·28·16 pixels over (14·2)² pixels an embedding
    assert images.encoder_cache.capacity * engine.model_config.hidden_size * 4 == \
        encoder_cache_bytes(engine.model_config, 64, 4, images.max_embeds)


def test_the_profile_encodes_the_largest_image(qwen_llm):
    engine = qwen_llm.engine
    runner, images = engine.runner, engine.images
    patches = []
    encode = runner.model.encode_image
    runner.model.encode_image = lambda data: patches.append(int(data["image_grid_thw"].prod())) or encode(data)
    try:
        config = dataclasses.replace(engine.config, gpu_memory_utilization=0.9)
        profile = MemoryProfile("cuda:0", 8 * GIB, 8 * GIB, GIB, GIB // 4, 0)
        executor = MeasuredExecutor([profile], runner)
        choose_num_blocks(config, engine.model_config, executor, torch.float32, 64, None, 0, images.max_embeds,
                          images.largest_image())
    finally:
        del runner.model.encode_image
    # One pass of the tower, at the largest image: 16 embeddings of 2 x 2 merged patches.
    assert patches == [images.max_embeds * 4]
    assert executor.images[0] is not None
    # What goes to every rank is the image's size, not its pixels: each rank makes the same tensors itself.
    assert len(pickle.dumps(executor.images[0])) < 1024
    spec = executor.images[0]
    blank = images.processor.pixels(Image.new("RGB", (spec.width, spec.height)))
    assert torch.equal(profile_pixels(spec)["pixel_values"], blank["pixel_values"])


def test_the_start_sizes_with_the_largest_image(qwen_llm, monkeypatch):
    """start_engine builds the image side before sizing and hands the sizing its largest image; the core then
    serves with that same image side (one processor, one encoder budget)."""
    import engine.executor.startup as startup
    seen, built = [], []
    real, image_inputs = startup.choose_num_blocks, startup.ImageInputs
    monkeypatch.setattr(startup, "choose_num_blocks", lambda *args: seen.append(args) or real(*args))
    monkeypatch.setattr(startup, "ImageInputs", lambda *args: built.append(image_inputs(*args)) or built[-1])
    llm = LLM(str(qwen_llm.engine.model_path), device="cpu", max_num_seqs=2, max_num_batched_tokens=64)
    assert llm.engine.images is built[0] and llm.engine.encoder_cache is built[0].encoder_cache
    assert seen[0][7] == built[0].max_embeds == 16
    assert seen[0][8] is None  # on CPU nothing is profiled: the image is made only for a card's profile


def test_the_pixel_cap_shrinks_the_largest_image(qwen_llm):
    """--max-image-pixels flows into the largest image by one rule: the engine's encoder budget and cache, its
    profile image and the planner's cache; and no image within the cap, of any shape, becomes more embeddings
    than that rule says (the processor's own resizing decides, checked here on the worst shapes)."""
    from engine.core.image_inputs import ImageInputs
    from engine.planning.vision import largest_image_embeds
    engine, cap = qwen_llm.engine, 28 * 28 * 6
    config = dataclasses.replace(engine.config, max_image_pixels=cap)
    images = ImageInputs(config, engine.model_config, engine.model_path, engine.tokenizer, 4)
    assert images.max_embeds == largest_image_embeds(engine.model_config.vision, cap, 16) < 16
    assert images.encoder_cache.capacity == 2 * images.max_embeds
    # The profile encodes the shape within the cap that rounds up the most: exactly the rule's count.
    assert int(profile_pixels(images.largest_image())["image_grid_thw"].prod()) == images.max_embeds * 4
    for width in (69, 100, 200, 300):  # a square to a strip 15 pixels high, each as many pixels as the cap allows
        grid = images.processor.pixels(Image.new("RGB", (width, cap // width)))["image_grid_thw"]
        assert int(grid.prod()) // 4 <= images.max_embeds
    cfg = gemma3_27b()
    assert largest_image_embeds(cfg.vision, 1) == 256  # Gemma 3's count is fixed: the cap changes nothing
    from engine.bench.hybrid import QWEN3_6_27B
    qwen = ModelConfig.from_hf_config(json.loads(json.dumps(QWEN3_6_27B)))
    full, capped = (plan_capacity(qwen, [24 * GIB], 0.9, max_num_batched_tokens=2048, max_num_seqs=4,
                                  max_image_pixels=p) for p in (None, 1920 * 1080))
    assert capped.encoder_cache_bytes == encoder_cache_bytes(qwen, 2048, 2, largest_image_embeds(qwen.vision,
                                                                                               1920 * 1080))
    assert capped.encoder_cache_bytes < full.encoder_cache_bytes and capped.activation_bytes < full.activation_bytes


def test_no_images_allowed_serves_the_checkpoint_as_text(qwen_llm):
    """--limit-mm-per-prompt '{"image": 0}' (vLLM's text-only mode): the tower is skipped by the loader, no encoder
    cache or profile image, an image is refused saying why, and the planner counts no tower."""
    from app.capacity import plan_for
    limit = '{"image": 0}'
    llm = LLM(str(qwen_llm.engine.model_path), device="cpu", max_num_seqs=2, max_num_batched_tokens=64,
              limit_mm_per_prompt=limit)
    engine = llm.engine
    assert engine.model_config.vision is None and engine.images.encoder_cache is None
    assert engine.images.largest_image() is None
    assert not any(name.startswith("visual.") for name, _ in engine.runner.model.named_parameters())
    assert engine.runner.weights_bytes() < qwen_llm.engine.runner.weights_bytes()
    with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
        engine.images.process("<|image_pad|>", [object()])
    hf = json.loads((engine.model_path / "config.json").read_text())
    plans = [plan_for(hf, values, [24 * GIB])[1] for values in ({}, {"limit_mm_per_prompt": limit})]
    assert plans[1].weights_bytes < plans[0].weights_bytes and plans[1].encoder_cache_bytes == 0


def test_the_server_processor_is_built_by_the_engine_image_side(qwen_llm):
    """The server's processor comes from ImageInputs (one place for the folder, vision config and pixel cap),
    over the server's own tokenizer copy."""
    import copy

    from engine.entrypoints.openai.served_model import image_side
    engine = qwen_llm.engine
    tokenizer = copy.deepcopy(engine.tokenizer)
    served = image_side(engine, tokenizer)["mm_processor"]
    assert served is not engine.images.processor and served.tokenizer is tokenizer
    assert served.max_embeds_per_image() == engine.images.max_embeds
    assert served.max_pixels == engine.config.max_image_pixels


@pytest.mark.parametrize("cap", [3000, 8000])
def test_the_pixel_cap_rule_is_pixtrals_processor(tmp_path_factory, cap):
    """Pixtral (Mistral3): the rule's largest image under a cap is what its processor makes of the worst shape
    (each side padded to whole patches, merged 2 x 2), and no shape within the cap becomes more."""
    from engine.core.tokenizer import load_tokenizer
    from engine.multimodal.processor import MultiModalProcessor
    from tiny_vl_models import make_tiny_mistral3_vl
    path = make_tiny_mistral3_vl(tmp_path_factory.mktemp("pixtral-cap"))
    vision = ModelConfig.from_folder(path).vision
    processor = MultiModalProcessor(path, vision, load_tokenizer(str(path)), cap)

    def embeds(width: int, height: int) -> int:
        rows, cols = (int(x) // processor.pixtral_patch for x in processor.pixels(
            Image.new("RGB", (width, height)))["image_sizes"][0])
        return rows * cols

    spec = processor.largest_image()
    assert embeds(spec.width, spec.height) == processor.max_embeds_per_image() < 16  # 16: the processor's own
    assert max(embeds(w, cap // w) for w in range(20, cap // 20)) == processor.max_embeds_per_image()
