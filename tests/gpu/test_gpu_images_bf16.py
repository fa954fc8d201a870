"""Images in bf16 on the card, every vision-language family (the rows of tests/image_families.py): the engine's
greedy reply to a two-image prompt agrees with HF's in bf16 on the card, teacher-forced (HF's argmax given the
same prompt, pixels and reply so far), a token within HF's own bf16 rounding of its maximum counting as
agreement, as tests/gpu/gpu_reference.py counts it for text (tiny random models have near-ties in bf16, so a
free-running comparison would diverge at the first and cascade). Skipped without CUDA; not yet run on a card."""
from __future__ import annotations

import pytest
import torch

from image_families import FAMILIES

pytestmark = pytest.mark.gpu
MIN_AGREEMENT = 0.9


@torch.inference_mode()
def hf_agreement_mm(path, inputs, reply: list[int]) -> float:
    """The share of `reply` HF picks in bf16 on the card, given the prompt, its images and the reply so far."""
    from transformers import AutoModelForImageTextToText

    from tiny_vl_models import hf_mm_kwargs
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    prompt = inputs.prompt_token_ids
    ids = torch.tensor([prompt + reply])
    kwargs = {k: v.to("cuda") for k, v in hf_mm_kwargs(model, inputs.items, ids).items()}
    kwargs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in kwargs.items()}
    logits = model(ids.to("cuda"), attention_mask=torch.ones_like(ids).to("cuda"), **kwargs).logits
    logits = logits[0, len(prompt) - 1:-1].float()
    agree = 0
    for j, ours in enumerate(reply):
        theirs = int(logits[j].argmax())
        rounding = torch.finfo(torch.bfloat16).eps * abs(float(logits[j, theirs]))
        agree += ours == theirs or float(logits[j, theirs] - logits[j, ours]) <= rounding
    return agree / max(1, len(reply))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_images_in_bf16_agree_with_hf(name, make_llm, tmp_path):
    from engine import SamplingParams
    from tiny_vl_models import random_image
    family = FAMILIES[name]
    path = family.make(tmp_path)
    llm = make_llm(path, dtype="bfloat16", max_num_batched_tokens=max(96, family.tp_budget))
    inputs = llm.engine.process_images(family.prompt("Compare.", 2), [random_image(100, 40, 1),
                                                                      random_image(56, 84, 2)])
    llm.engine.add_request(f"gpu-bf16-{name}", inputs.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), mm=inputs)
    reply = llm._run([f"gpu-bf16-{name}"], use_tqdm=False)[0].outputs[0].token_ids
    assert len(reply) == 16
    assert hf_agreement_mm(path, inputs, reply) >= MIN_AGREEMENT
