"""Images into Mistral3 (Mistral-Small-3.x: the Pixtral tower and projector; an image is rows of [IMG] each ending
in [IMG_BREAK], the last in [IMG_END], only the [IMG] tokens taking embeddings): greedy ids identical to HF
`generate` on the same processor outputs for one image, two images and sizes not a multiple of the patch; under
chunked prefill cutting an image, prefix caching (a hit with the same image, a miss with another), forced
preemption, n > 1 and tensor parallel 2."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tiny_models import hf_model
from tiny_vl_models import hf_greedy_mm, make_tiny_mistral3_vl, random_image

pytest.importorskip("PIL")
MAX_TOKENS = 10


def prompt(text: str, images: int) -> str:
    return f"[INST]{'[IMG]' * images}{text}[/INST]"


CASES = [("Describe this.", [(56, 84)], [0]), ("Compare the two pictures.", [(100, 40), (30, 30)], [1, 2]),
         ("What is odd here?", [(50, 70)], [3])]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    path = make_tiny_mistral3_vl(tmp_path_factory.mktemp("mistral3-vl"))
    llm = LLM(str(path), device="cpu", max_num_seqs=4)
    cases = [llm.engine.process_images(prompt(text, len(sizes)), [random_image(w, h, s) for (w, h), s in
                                                                  zip(sizes, seeds)])
             for text, sizes, seeds in CASES]
    hf = hf_model(path)
    return path, llm, cases, [hf_greedy_mm(hf, inputs, MAX_TOKENS) for inputs in cases]


def run(llm, cases, n: int = 1):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=n)
    ids = []
    for i, inputs in enumerate(cases):
        request_id = f"m{id(cases)}-{i}-{n}-{len(llm.engine.requests)}"
        llm.engine.add_request(request_id, inputs.prompt_token_ids, params, mm=inputs)
        ids.append(request_id)
    return [[c.token_ids for c in out.outputs] for out in llm._run(ids, use_tqdm=False)]


def test_greedy_matches_hf(family):
    path, llm, cases, expected = family
    assert llm.engine.takes_images and not llm.engine.scheduler.whole_images
    # 84 x 56 pixels: 3 rows of 2 embeddings, each row closed by a break or the end token
    assert [(i.length, i.num_embeds) for i in cases[0].items] == [(9, 6)]
    assert [o[0] for o in run(llm, cases)] == expected


def test_chunked_prefill_cutting_an_image(family):
    path, _, cases, expected = family
    small = LLM(str(path), device="cpu", max_num_batched_tokens=4, max_num_seqs=4, enable_prefix_caching=False)
    assert [o[0] for o in run(small, cases)] == expected
    assert small.engine.encoder_cache.num_encoded == 4  # each image once, though its tokens span several steps


def test_prefix_hit_with_the_same_image_and_miss_with_another(family):
    path, _, cases, expected = family
    fresh = LLM(str(path), device="cpu", max_num_seqs=4, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    request = {"prompt": prompt("Describe this.", 1), "multi_modal_data": {"image": random_image(56, 84, 0)}}
    first = fresh.generate([request], params, use_tqdm=False)[0]
    again = fresh.generate([request], params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    other = fresh.engine.process_images(prompt("Describe this.", 1), [random_image(56, 84, 9)])
    out = fresh.generate([{"prompt": prompt("Describe this.", 1), "multi_modal_data": {"image": random_image(56, 84, 9)}}],
                         params, use_tqdm=False)[0]
    assert out.num_cached_tokens <= other.items[0].offset
    assert out.outputs[0].token_ids == hf_greedy_mm(hf_model(path), other, MAX_TOKENS)


def test_forced_preemption(family):
    path, _, cases, expected = family
    tiny = LLM(str(path), device="cpu", max_num_batched_tokens=16, num_gpu_blocks_override=6, max_num_seqs=3,
               block_size=8)
    assert [o[0] for o in run(tiny, cases)] == expected
    assert tiny.engine.scheduler.num_preemptions > 0


def test_n_greater_than_one(family):
    path, llm, cases, expected = family
    assert run(llm, cases[:1], n=2) == [[expected[0], expected[0]]]


def test_tensor_parallel_2(family):
    import torch.distributed as dist
    path, _, cases, expected = family
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=8, max_num_seqs=4)
    try:
        assert [o[0] for o in run(llm, cases)] == expected
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()
