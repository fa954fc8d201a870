"""Images into Gemma 4 (its own vision tower: 2-D RoPE over patch positions, pooled to soft tokens, projected by
`embed_vision`), what only Gemma 4 has beside the shared tests (tests/test_images_families.py: HF parity for one
image, two images and a strip far from square, chunked prefill, prefix caching, forced preemption, n > 1, TP=2):
the token-type mask deciding the first logprob, causal images where the checkpoint says so, the folder served as
text, async scheduling, the soft tokens themselves against HF's in float32 and bf16, and the planner's count. The
tiny checkpoint (tests/tiny_vl_models.make_tiny_gemma4_vl) is built as the E2B/E4B are (per-layer inputs, KV
sharing by the last two of six layers, so a global layer's image rows reach a later layer's keys) with
`use_bidirectional_attention: "vision"` (HF's switch for the larger models: an image's tokens see each other both
ways on the sliding layers only); a second one without it (causal images) has a tower that clips its projections.
"""
from __future__ import annotations

import pytest
import torch

from image_families import GEMMA4_CASES as CASES, MAX_TOKENS, gemma4_prompt as prompt, mask_logprobs, run as run_all
from tiny_models import hf_model
from tiny_vl_models import GEMMA4_VISION as VISION, hf_greedy_mm, make_tiny_gemma4_vl, random_image

pytest.importorskip("PIL")


def hf_greedy(model, inputs, max_tokens: int = MAX_TOKENS) -> list[int]:
    return hf_greedy_mm(model, inputs, max_tokens)


@pytest.fixture(scope="module")
def family(image_family):
    built = image_family("gemma4-vl")
    return built.path, built.llm, built.cases, built.expected


def run(llm, cases):
    return [outs[0] for outs in run_all(llm, cases)]


def test_the_image_mask_decides(family):
    """The first token's logprob is HF's with the token types (both ways within an image, sliding layers only),
    not HF's without them: the key limits, and their absence on the global layers, are what the parity rests on."""
    path, llm, cases, expected = family
    hf, inputs = hf_model(path), cases[1]
    pixels = torch.cat([item.data["pixel_values"] for item in inputs.items])
    positions = torch.cat([item.data["image_position_ids"] for item in inputs.items])
    ours, bidirectional, causal = mask_logprobs(
        llm, hf, inputs, expected[1][0],
        lambda ids, types: hf(ids, pixel_values=pixels, image_position_ids=positions, mm_token_type_ids=types,
                              attention_mask=torch.ones_like(ids)).logits)
    assert abs(bidirectional - causal) > 1e-3
    assert abs(ours - bidirectional) < 1e-4


def test_causal_images_where_the_checkpoint_says_so(tmp_path):
    """Without use_bidirectional_attention "vision" (E2B/E4B as published) HF keeps image tokens causal: so does
    the engine, and a chunk may then end inside an image. The tower here clips its projections (the bounds are
    checkpoint tensors, loaded per stacked shard)."""
    from engine import LLM
    path = make_tiny_gemma4_vl(tmp_path, seed=1, bidirectional=None, clipped=True)
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=False)
    assert llm.engine.takes_images and not llm.engine.scheduler.whole_images
    assert not llm.engine.model_config.vision.bidirectional
    cases = [llm.engine.process_images(prompt(text, len(sizes)), [random_image(w, h, s) for (w, h), s in
                                                                  zip(sizes, seeds)])
             for text, sizes, seeds in CASES]
    hf = hf_model(path)
    assert run(llm, cases) == [hf_greedy(hf, inputs) for inputs in cases]


def test_served_as_text_without_its_image_processor(family, tmp_path):
    """The same folder less its preprocessor_config.json: the tower is never loaded, text answers as HF's."""
    import shutil
    from types import SimpleNamespace

    from engine import LLM, SamplingParams
    path, _, _, _ = family
    text_only = tmp_path / "text-only"
    shutil.copytree(path, text_only)
    (text_only / "preprocessor_config.json").unlink()
    llm = LLM(str(text_only), device="cpu", max_num_seqs=2)
    assert not llm.engine.takes_images and llm.engine.model_config.vision is None
    out = llm.generate([prompt("Say something.", 0)], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model(path), SimpleNamespace(
        prompt_token_ids=out.prompt_token_ids, items=[]))


def test_the_planner_counts_the_tower_exactly_as_loaded(family):
    from engine.config.model import ModelConfig
    from engine.models.registry import model_class
    from engine.planning.vision import default_max_embeds, tower_params
    from engine.planning.weights import weights_bytes_per_card
    from engine.worker.loader import iterate_weights
    path, _, _, _ = family
    cfg = ModelConfig.from_folder(path)
    model = model_class(cfg.architecture)(cfg)
    model.load_weights(iterate_weights(path))
    tower = sum(p.numel() for name, p in model.named_parameters() if name.startswith(("vision_tower.",
                                                                                         "embed_vision.")))
    assert tower and tower_params(cfg.vision, cfg.hidden_size) == tower
    assert weights_bytes_per_card(cfg, 4) == sum(p.numel() * p.element_size() for p in model.parameters())
    assert default_max_embeds(cfg.vision) == 280
    clipped = dict(cfg.vision.tower, use_clipped_linears=True)
    from dataclasses import replace
    assert tower_params(replace(cfg.vision, tower=clipped), cfg.hidden_size) == tower + 2 * 4 * 7


def test_a_step_too_small_for_a_whole_image_is_refused_at_start(family):
    """Both ways within an image: a step must hold the largest image the processor makes (70 soft tokens here)."""
    from engine import LLM
    path, _, _, _ = family
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        LLM(str(path), device="cpu", max_num_batched_tokens=64)


@pytest.mark.parametrize("switch,both_ways", [("vision", True), (None, False)])
def test_bidirectional_only_where_the_config_says_vision(switch, both_ways):
    """HF's Gemma4Model builds the image block mask only for use_bidirectional_attention == "vision"."""
    from engine.config.vision import parse_vision_config
    hf = {"vision_config": dict(VISION), "text_config": {"use_bidirectional_attention": switch},
          "image_token_id": 9, "boi_token_id": 7, "eoi_token_id": 8}
    vision = parse_vision_config(hf, "Gemma4ForConditionalGeneration")
    assert (vision.kind, vision.bidirectional, vision.start_token_id, vision.end_token_id) == ("gemma4", both_ways,
                                                                                              7, 8)


def test_whole_images_run_ahead_under_async_scheduling(family):
    """--async-scheduling: steps carrying Gemma 4's encoder work run ahead like any other; HF's ids, every image
    entry released at the end."""
    from engine import LLM
    path, _, cases, expected = family
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=72, max_num_seqs=4, async_scheduling=True)
    assert llm.engine.async_scheduling
    assert run(llm, cases) == expected
    assert not any(llm.engine.encoder_cache.holders.values())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_soft_tokens_match_hf_get_image_features(family, dtype, tol):
    """The tower and embedder alone, image by image, against HF's get_image_features (padding patches and all),
    in float32 and in bf16 (the pooled cells rounded to bf16 before the sqrt(hidden) scale, as HF does)."""
    from engine.config.model import ModelConfig
    from engine.models.registry import model_class
    from engine.worker.loader import iterate_weights
    path, _, cases, _ = family
    cfg = ModelConfig.from_folder(path)
    ours = model_class(cfg.architecture)(cfg)
    ours.load_weights(iterate_weights(path))
    ours.vision_tower.to(dtype), ours.embed_vision.to(dtype)
    hf = hf_model(path).to(dtype)
    for item in [item for case in cases for item in case.items]:
        with torch.no_grad():
            got = ours.encode_image(item.data).float()
            want = hf.model.get_image_features(item.data["pixel_values"].to(dtype), item.data["image_position_ids"],
                                               return_dict=True).pooler_output[0].float()
        assert got.shape == want.shape == (item.length, cfg.hidden_size)
        assert float((got - want).abs().max()) <= tol * float(want.abs().max())
