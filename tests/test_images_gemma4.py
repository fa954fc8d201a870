"""Images into Gemma 4 (its own vision tower: 2-D RoPE over patch positions, pooled to soft tokens, projected by
`embed_vision`): greedy ids identical to HF `generate` on the same processor outputs for one image, two images in
one prompt and a strip far from square; under chunked prefill, prefix caching (a hit with the same image, a miss
with another), forced preemption, n > 1, async scheduling and TP=2; the soft tokens themselves against HF's in
float32 and bf16; the planner's count. The tiny checkpoint is built as the E2B/E4B are (per-layer inputs, KV
sharing by the last two of six layers, so a global layer's image rows reach a later layer's keys) with
`use_bidirectional_attention: "vision"` (HF's switch for the larger models: an image's tokens see each other both
ways on the sliding layers only); a second one without it (causal images) has a tower that clips its projections.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tiny_models import ARCHS, _tokenizer, hf_model
from tiny_vl_models import random_image

pytest.importorskip("PIL")
MAX_TOKENS = 10
BLOCKS = 30  # 8-token blocks: three image prompts at once do not fit, the scheduler preempts
IMAGE_TOKENS = ["<|image>", "<image|>", "<|image|>"]  # begin, end, soft token (Gemma 4's own spellings)
# 4-pixel patches pooled 3 x 3: an image becomes at most 70 soft tokens (the processor's smallest budget).
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
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
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"] + IMAGE_TOKENS})
    boi, eoi, image = tokenizer.convert_tokens_to_ids(IMAGE_TOKENS)
    text = dict(ARCHS["gemma4"][2], vocab_size=len(tokenizer) + 12, hidden_size=64, intermediate_size=128,
                num_attention_heads=4, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6,
                use_bidirectional_attention=bidirectional, num_hidden_layers=6,
                layer_types=["sliding_attention", "full_attention"] * 3)
    text["vocab_size_per_layer_input"] = text["vocab_size"]
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("gemma4", text_config=text, vision_config=dict(VISION, use_clipped_linears=clipped),
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


def hf_greedy(model, inputs, max_tokens: int = MAX_TOKENS) -> list[int]:
    """HF generate on the engine processor's outputs: the expanded ids, each image's padded patches and patch
    positions, and the token types that make HF's mask bidirectional within an image."""
    ids = torch.tensor([inputs.prompt_token_ids])
    kwargs = {}
    if inputs.items:
        kwargs = dict(pixel_values=torch.cat([item.data["pixel_values"] for item in inputs.items]),
                      image_position_ids=torch.cat([item.data["image_position_ids"] for item in inputs.items]),
                      mm_token_type_ids=(ids == model.config.image_token_id).long())
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             **kwargs)
    return out[0, ids.shape[1]:].tolist()


def prompt(text: str, images: int) -> str:
    return f"<start_of_turn>user\n{'<|image|>' * images}{text}<end_of_turn>\n<start_of_turn>model\n"


CASES = [("Describe this.", [(56, 84)], [0]), ("Compare the two pictures.", [(100, 40), (30, 30)], [1, 2]),
         ("What is odd here?", [(200, 12)], [3])]  # a strip: 2 x 34 soft tokens


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from engine import LLM
    path = make_tiny_gemma4_vl(tmp_path_factory.mktemp("gemma4-vl"))
    llm = LLM(str(path), device="cpu", max_num_seqs=4)
    cases = [llm.engine.process_images(prompt(text, len(sizes)), [random_image(w, h, s) for (w, h), s in
                                                                  zip(sizes, seeds)])
             for text, sizes, seeds in CASES]
    hf = hf_model(path)
    return path, llm, cases, [hf_greedy(hf, inputs) for inputs in cases]


def run(llm, cases):
    from engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ids = []
    for i, inputs in enumerate(cases):
        request_id = f"g4-{id(cases)}-{i}-{len(llm.engine.requests)}"
        llm.engine.add_request(request_id, inputs.prompt_token_ids, params, mm=inputs)
        ids.append(request_id)
    return [out.outputs[0].token_ids for out in llm._run(ids, use_tqdm=False)]


def test_greedy_matches_hf(family):
    path, llm, cases, expected = family
    assert llm.engine.takes_images and llm.engine.scheduler.whole_images
    lengths = [[item.length for item in case.items] for case in cases]
    assert lengths == [[int(item.data["num_soft_tokens_per_image"][0]) for item in case.items] for case in cases]
    assert run(llm, cases) == expected


def test_the_image_mask_decides(family):
    """The first token's logprob is HF's with the token types (both ways within an image, sliding layers only),
    not HF's without them: the key limits, and their absence on the global layers, are what the parity rests on."""
    from engine import SamplingParams
    path, llm, cases, expected = family
    hf, inputs = hf_model(path), cases[1]
    ids = torch.tensor([inputs.prompt_token_ids])
    pixels = torch.cat([item.data["pixel_values"] for item in inputs.items])
    positions = torch.cat([item.data["image_position_ids"] for item in inputs.items])
    first = expected[1][0]

    def hf_logprob(token_types: torch.Tensor) -> float:
        with torch.no_grad():
            logits = hf(ids, pixel_values=pixels, image_position_ids=positions, mm_token_type_ids=token_types,
                        attention_mask=torch.ones_like(ids)).logits[0, -1]
        return logits.float().log_softmax(-1)[first].item()

    request_id = f"mask-{len(llm.engine.requests)}"
    llm.engine.add_request(request_id, inputs.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=1, logprobs=0), mm=inputs)
    ours = llm._run([request_id], use_tqdm=False)[0].outputs[0].logprobs[0][first].logprob
    bidirectional, causal = hf_logprob((ids == hf.config.image_token_id).long()), hf_logprob(torch.zeros_like(ids))
    assert abs(bidirectional - causal) > 1e-3
    assert abs(ours - bidirectional) < 1e-4


def test_chunked_prefill_never_ends_inside_an_image(family):
    from engine import LLM
    path, _, cases, expected = family
    small = LLM(str(path), device="cpu", max_num_batched_tokens=72, max_num_seqs=4, enable_prefix_caching=False)
    assert run(small, cases) == expected
    assert small.engine.encoder_cache.num_encoded == 4


def test_prefix_hit_with_the_same_image_and_miss_with_another(family):
    from engine import LLM, SamplingParams
    path, _, cases, expected = family
    fresh = LLM(str(path), device="cpu", max_num_seqs=4, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    request = {"prompt": prompt("Describe this.", 1), "multi_modal_data": {"image": random_image(56, 84, 0)}}
    first = fresh.generate([request], params, use_tqdm=False)[0]
    again = fresh.generate([request], params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 64
    other_image = random_image(56, 84, 9)
    other = fresh.engine.process_images(prompt("Describe this.", 1), [other_image])
    out = fresh.generate([{"prompt": prompt("Describe this.", 1), "multi_modal_data": {"image": other_image}}],
                         params, use_tqdm=False)[0]
    assert out.num_cached_tokens <= other.items[0].offset
    assert out.outputs[0].token_ids == hf_greedy(hf_model(path), other)


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


def test_tensor_parallel_2(family):
    """The tower replicated on both ranks (engine/models/vision.py), the text model split: the same ids."""
    import torch.distributed as dist

    from engine import LLM
    path, _, cases, expected = family
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=72, max_num_seqs=4)
    try:
        assert run(llm, cases) == expected
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()


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


def test_forced_preemption_and_n_greater_than_one(family):
    from engine import LLM, SamplingParams
    path, llm, cases, expected = family
    tiny = LLM(str(path), device="cpu", max_num_batched_tokens=72, num_gpu_blocks_override=BLOCKS, max_num_seqs=3,
               block_size=8)
    assert run(tiny, cases + cases[:1]) == expected + expected[:1]
    assert tiny.engine.scheduler.num_preemptions > 0
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=2)
    llm.engine.add_request("g4-n2", cases[0].prompt_token_ids, params, mm=cases[0])
    assert [c.token_ids for c in llm._run(["g4-n2"], use_tqdm=False)[0].outputs] == [expected[0]] * 2


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
