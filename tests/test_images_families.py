"""What every vision-language family shares, one row per family (tests/image_families.py): greedy ids identical to
HF `generate` on the same processor outputs for one image, two images in one prompt and an odd size; under chunked
prefill whose budget cuts an image (or, where an image's tokens attend both ways, ends the chunk before it), prefix
caching (a hit with the same image, a miss with another), forced preemption, n > 1 and tensor parallel 2 (the tower
replicated on both ranks, engine/models/vision.py; the text model split)."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from image_families import FAMILIES, MAX_TOKENS, first_ids, run
from tiny_models import hf_model
from tiny_vl_models import random_image

pytest.importorskip("PIL")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, image_family):
    return image_family(request.param)


def test_greedy_matches_hf(family):
    family.family.check_items(family.llm, family.cases)
    assert first_ids(family.llm, family.cases) == family.expected


def test_chunked_prefill_cutting_an_image(family):
    small = LLM(str(family.path), device="cpu", max_num_batched_tokens=family.family.chunk_budget, max_num_seqs=4,
                enable_prefix_caching=False)
    assert first_ids(small, family.cases) == family.expected
    assert small.engine.encoder_cache.num_encoded == 4  # each image once, though its tokens span several steps


def test_prefix_hit_with_the_same_image_and_miss_with_another(family):
    row = family.family
    fresh = LLM(str(family.path), device="cpu", max_num_seqs=4, **row.prefix)
    block_size = fresh.engine.config.block_size
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    request = {"prompt": row.prompt("Describe this.", 1), "multi_modal_data": {"image": random_image(56, 84, 0)}}
    first = fresh.generate([request], params, use_tqdm=False)[0]
    again = fresh.generate([request], params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == family.expected[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= row.min_cached
    other = fresh.engine.process_images(row.prompt("Describe this.", 1), [random_image(56, 84, 9)])
    out = fresh.generate([{"prompt": row.prompt("Describe this.", 1),
                           "multi_modal_data": {"image": random_image(56, 84, 9)}}], params, use_tqdm=False)[0]
    # only the text before the image's block is shared
    assert out.num_cached_tokens <= other.items[0].offset // block_size * block_size
    assert out.outputs[0].token_ids == row.hf_greedy(hf_model(family.path), other, MAX_TOKENS)
    if row.image_decides:
        assert out.outputs[0].token_ids != family.expected[0]  # the image, not only the text, decides the answer


def test_forced_preemption(family):
    row = family.family
    tiny = LLM(str(family.path), device="cpu", **row.preempt)
    cases = family.cases + family.cases[:row.preempt_extra]
    assert first_ids(tiny, cases) == family.expected + family.expected[:row.preempt_extra]
    assert tiny.engine.scheduler.num_preemptions > 0


def test_n_greater_than_one(family):
    assert run(family.llm, family.cases[:1], n=2) == [[family.expected[0], family.expected[0]]]


def test_tensor_parallel_2(family):
    import torch.distributed as dist
    llm = LLM(str(family.path), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=family.family.tp_budget,
              max_num_seqs=4)
    try:
        assert first_ids(llm, family.cases) == family.expected
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()
