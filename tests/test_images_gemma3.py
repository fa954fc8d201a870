"""Images into Gemma 3 (SigLIP tower + projector, an image's tokens attending to each other both ways): greedy ids
identical to HF `generate` on the same processor outputs for one image, two images and a size the processor
resizes; under chunked prefill whose budget would cut an image (the scheduler ends the chunk before it), prefix
caching (a hit with the same image, a miss with another), forced preemption and n > 1."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tiny_models import hf_model
from tiny_vl_models import hf_greedy_mm, make_tiny_gemma3_vl, random_image

pytest.importorskip("PIL")
MAX_TOKENS = 10


def prompt(text: str, images: int) -> str:
    return f"<start_of_turn>user\n{'<start_of_image>' * images}{text}<end_of_turn>\n<start_of_turn>model\n"


CASES = [("Describe this.", [(56, 84)], [0]), ("Compare the two pictures.", [(100, 40), (30, 30)], [1, 2]),
         ("What is odd here?", [(50, 70)], [3])]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    path = make_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl"))
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
        request_id = f"g{id(cases)}-{i}-{n}-{len(llm.engine.requests)}"
        llm.engine.add_request(request_id, inputs.prompt_token_ids, params, mm=inputs)
        ids.append(request_id)
    return [[c.token_ids for c in out.outputs] for out in llm._run(ids, use_tqdm=False)]


def test_greedy_matches_hf(family):
    path, llm, cases, expected = family
    assert llm.engine.takes_images and llm.engine.scheduler.whole_images
    assert [[i.length for i in c.items] for c in cases] == [[4], [4, 4], [4]]
    assert [o[0] for o in run(llm, cases)] == expected


def test_the_image_mask_decides(family):
    """The first token's logprob is HF's with the token types (an image's tokens see each other both ways), not
    HF's without them (causal image tokens): the key limits are what the parity above rests on."""
    path, llm, cases, expected = family
    hf, inputs = hf_model(path), cases[1]
    ids = torch.tensor([inputs.prompt_token_ids])
    pixels = torch.cat([item.data["pixel_values"] for item in inputs.items])
    first = expected[1][0]

    def hf_logprob(token_types: torch.Tensor) -> float:
        with torch.no_grad():
            logits = hf(ids, pixel_values=pixels, token_type_ids=token_types).logits[0, -1]
        return logits.float().log_softmax(-1)[first].item()

    request_id = f"mask-{len(llm.engine.requests)}"
    llm.engine.add_request(request_id, inputs.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=1, logprobs=0), mm=inputs)
    ours = llm._run([request_id], use_tqdm=False)[0].outputs[0].logprobs[0][first].logprob
    bidirectional, causal = hf_logprob((ids == hf.config.image_token_id).long()), hf_logprob(torch.zeros_like(ids))
    assert abs(bidirectional - causal) > 1e-3
    assert abs(ours - bidirectional) < 1e-4


def test_chunked_prefill_never_ends_inside_an_image(family):
    path, _, cases, expected = family
    small = LLM(str(path), device="cpu", max_num_batched_tokens=10, max_num_seqs=4, enable_prefix_caching=False)
    assert [o[0] for o in run(small, cases)] == expected
    assert small.engine.encoder_cache.num_encoded == 4


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
    tiny = LLM(str(path), device="cpu", max_num_batched_tokens=16, num_gpu_blocks_override=14, max_num_seqs=3,
               block_size=8)
    assert [o[0] for o in run(tiny, cases)] == expected
    assert tiny.engine.scheduler.num_preemptions > 0


def test_n_greater_than_one(family):
    path, llm, cases, expected = family
    assert run(llm, cases[:1], n=2) == [[expected[0], expected[0]]]


def test_tensor_parallel_2(family):
    """The tower replicated on both ranks (engine/models/vision.py), the text model split: the same ids."""
    import torch.distributed as dist
    path, _, cases, expected = family
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=10, max_num_seqs=4)
    try:
        assert [o[0] for o in run(llm, cases)] == expected
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()


def test_a_step_too_small_for_a_whole_image_is_refused_at_start(family):
    path, _, _, _ = family
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        LLM(str(path), device="cpu", max_num_batched_tokens=3)
