"""Images into Gemma 3 (SigLIP tower + projector, an image's tokens attending to each other both ways), what only
Gemma 3 has beside the shared tests (tests/test_images_families.py: HF parity, chunked prefill ending before an
image, prefix caching, forced preemption, n > 1, TP=2): the token-type mask deciding the first logprob, and a step
too small for a whole image refused at start."""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from image_families import mask_logprobs
from tiny_models import hf_model

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def family(image_family):
    built = image_family("gemma3-vl")
    return built.path, built.llm, built.cases, built.expected


def test_the_image_mask_decides(family):
    """The first token's logprob is HF's with the token types (an image's tokens see each other both ways), not
    HF's without them (causal image tokens): the key limits are what the parity above rests on."""
    path, llm, cases, expected = family
    hf, inputs = hf_model(path), cases[1]
    pixels = torch.cat([item.data["pixel_values"] for item in inputs.items])
    ours, bidirectional, causal = mask_logprobs(
        llm, hf, inputs, expected[1][0], lambda ids, types: hf(ids, pixel_values=pixels, token_type_ids=types).logits)
    assert abs(bidirectional - causal) > 1e-3
    assert abs(ours - bidirectional) < 1e-4


def test_a_step_too_small_for_a_whole_image_is_refused_at_start(family):
    path, _, _, _ = family
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        LLM(str(path), device="cpu", max_num_batched_tokens=3)
