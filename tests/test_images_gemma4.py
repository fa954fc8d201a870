"""Images into Gemma 4 (its own vision tower: 2-D RoPE over patch positions, pooled to soft tokens, projected by
`embed_vision`): greedy ids identical to HF `generate` on the same processor outputs for one image and two images
in one prompt, prefix caching (a hit with the same image, a miss with another) and TP=2. The tiny checkpoint is
built as the E2B/E4B are (per-layer inputs, KV sharing) with `use_bidirectional_attention: "vision"` (the 31B's
switch: an image's tokens see each other both ways on the sliding layers only, as HF's mask has it)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tiny_models import ARCHS, _tokenizer, hf_model
from tiny_vl_models import random_image

pytest.importorskip("PIL")
MAX_TOKENS = 10
IMAGE_TOKENS = ["<|image>", "<image|>", "<|image|>"]  # begin, end, soft token (Gemma 4's own spellings)
# 4-pixel patches pooled 3 x 3: an image becomes at most 70 soft tokens (the processor's smallest budget).
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=64,
              standardize=True)


def make_tiny_gemma4_vl(tmp_dir: str | Path, seed: int = 0, bidirectional: str | None = "vision") -> Path:
    """Gemma 4 (E2B-shaped text model) with a vision tower and `embed_vision`, its PIL image processor and the
    image tokens in the vocabulary; no audio tower."""
    import transformers
    from transformers import GenerationConfig, Gemma4ImageProcessorPil

    tokenizer = copy.deepcopy(_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"] + IMAGE_TOKENS})
    boi, eoi, image = tokenizer.convert_tokens_to_ids(IMAGE_TOKENS)
    text = dict(ARCHS["gemma4"][2], vocab_size=len(tokenizer) + 12, hidden_size=64, intermediate_size=128,
                num_attention_heads=4, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6,
                use_bidirectional_attention=bidirectional)
    text["vocab_size_per_layer_input"] = text["vocab_size"]
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("gemma4", text_config=text, vision_config=dict(VISION),
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


CASES = [("Describe this.", [(56, 84)], [0]), ("Compare the two pictures.", [(100, 40), (30, 30)], [1, 2])]


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
