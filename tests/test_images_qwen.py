"""Images into Qwen3.5 VL (dense and MoE): greedy ids identical to HF `generate` on the same processor outputs,
for one image, two images, and an image whose size is not a multiple of the patch; under chunked prefill that
cuts an image, prefix caching (a hit with the same image, a miss with another), forced preemption and n > 1;
and the offline API's shapes (`multi_modal_data`, `LLM.chat` image parts)."""
from __future__ import annotations

import base64
import io

import pytest

from engine import LLM, SamplingParams
from tiny_models import hf_model
from tiny_vl_models import hf_greedy_mm, make_tiny_vl_model, random_image

pytest.importorskip("PIL")
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 10


def prompt(text: str, images: int) -> str:
    return f"<|im_start|>user\n{PLACEHOLDER * images}{text}<|im_end|>\n<|im_start|>assistant\n"


CASES = [  # (text, image sizes (w, h), seeds)
    ("Describe this.", [(56, 84)], [0]),
    ("Compare the two pictures.", [(448, 448), (84, 56)], [1, 2]),
    ("What is odd here?", [(50, 70)], [3]),  # not a multiple of the 14-pixel patch
]


@pytest.fixture(scope="module", params=["qwen3_5-vl", "qwen3_5_moe-vl"])
def family(request, tmp_path_factory):
    """(model path, engine processor inputs per case, HF's greedy ids per case)."""
    path = make_tiny_vl_model(tmp_path_factory.mktemp(request.param), request.param)
    llm = LLM(str(path), device="cpu", max_num_seqs=4)
    cases = [llm.engine.process_images(prompt(text, len(sizes)), [random_image(w, h, s) for (w, h), s in
                                                                  zip(sizes, seeds)])
             for text, sizes, seeds in CASES]
    hf = hf_model(path)
    expected = [hf_greedy_mm(hf, inputs, MAX_TOKENS) for inputs in cases]
    return path, llm, cases, expected


def run(llm, cases, n: int = 1):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=n)
    ids = []
    for i, inputs in enumerate(cases):
        request_id = f"t{id(cases)}-{i}-{n}-{len(llm.engine.requests)}"
        llm.engine.add_request(request_id, inputs.prompt_token_ids, params, mm=inputs)
        ids.append(request_id)
    return [[c.token_ids for c in out.outputs] for out in llm._run(ids, use_tqdm=False)]


def test_greedy_matches_hf(family):
    path, llm, cases, expected = family
    assert [o[0] for o in run(llm, cases)] == expected
    assert all(inputs.items for inputs in cases)
    assert [len(c.items) for c in cases] == [1, 2, 1]


def test_chunked_prefill_cutting_an_image(family):
    path, _, cases, expected = family
    small = LLM(str(path), device="cpu", max_num_batched_tokens=7, max_num_seqs=4, enable_prefix_caching=False)
    assert [o[0] for o in run(small, cases)] == expected
    assert small.engine.encoder_cache.num_encoded == 4  # each image once, though its tokens span several steps


def test_prefix_hit_with_the_same_image_and_miss_with_another(family):
    path, llm, cases, expected = family
    fresh = LLM(str(path), device="cpu", max_num_seqs=4)
    first = fresh.generate([{"prompt": prompt("Describe this.", 1), "multi_modal_data": {"image": random_image(56, 84, 0)}}],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    again = fresh.generate([{"prompt": prompt("Describe this.", 1), "multi_modal_data": {"image": random_image(56, 84, 0)}}],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    other = fresh.engine.process_images(prompt("Describe this.", 1), [random_image(56, 84, 9)])
    image_block = other.items[0].offset // 16
    out = fresh.generate([{"prompt": prompt("Describe this.", 1), "multi_modal_data": {"image": random_image(56, 84, 9)}}],
                         SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert out.num_cached_tokens <= image_block * 16  # only the text before the image's block is shared
    assert out.outputs[0].token_ids == hf_greedy_mm(hf_model(path), other, MAX_TOKENS)
    assert out.outputs[0].token_ids != expected[0]  # the image, not only the text, decides the answer


def test_forced_preemption(family):
    path, _, cases, expected = family
    tiny = LLM(str(path), device="cpu", max_num_batched_tokens=16, num_gpu_blocks_override=8, max_num_seqs=3)
    assert [o[0] for o in run(tiny, cases)] == expected
    assert tiny.engine.scheduler.num_preemptions > 0


def test_n_greater_than_one(family):
    path, llm, cases, expected = family
    assert run(llm, cases[:1], n=2) == [[expected[0], expected[0]]]


def test_offline_shapes(family, tmp_path):
    path, llm, cases, expected = family
    image = random_image(56, 84, 0)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    out = llm.generate({"prompt": prompt("Describe this.", 1), "multi_modal_data": {"image": [image]}}, params,
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected[0]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image_pil", "image_pil": image}):
        chat = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "Describe this."}]}], params,
                        use_tqdm=False)
        assert chat[0].outputs[0].token_ids == expected[0]


def test_bad_inputs_are_errors_never_dropped(family):
    path, llm, cases, expected = family
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": random_image(56, 56)}}, use_tqdm=False)
    with pytest.raises(ValueError, match="images only"):
        llm.generate({"prompt": "x", "multi_modal_data": {"audio": b""}}, use_tqdm=False)
    with pytest.raises(ValueError, match="does not use"):
        llm.generate({"prompt": "x", "mm_data": {}}, use_tqdm=False)
    assert [o[0] for o in run(llm, cases[:1])] == expected[:1]  # and it keeps serving


def test_tensor_parallel_2(family):
    """The tower replicated on both ranks (engine/models/vision.py), the text model split, chunks cutting images."""
    import torch.distributed as dist
    path, _, cases, expected = family
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        assert [o[0] for o in run(llm, cases)] == expected
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()


def test_speculative_verify_keeps_mrope_positions(family):
    """n-gram drafts verified over an image prompt: the verify rows continue the prompt's mRoPE positions (index +
    delta past the image), so drafts are accepted and the ids are the plain engine's (HF's, above)."""
    path, llm, cases, expected = family
    spec = LLM(str(path), device="cpu", max_num_seqs=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                   "prompt_lookup_min": 1})
    assert [o[0] for o in run(spec, cases)] == expected
    request = {"prompt": prompt("Describe this.", 1), "multi_modal_data": {"image": random_image(56, 84, 0)}}
    params = SamplingParams(temperature=0, max_tokens=30)
    assert spec.generate([request], params, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate([request], params, use_tqdm=False)[0].outputs[0].token_ids
    stats = spec.engine.spec.stats
    assert stats.num_draft_tokens > 0
    if path.name == "tiny-qwen3_5-vl":  # its reply repeats itself: right drafts, kept only at the right positions
        assert stats.num_accepted_tokens > 0  # (the MoE's repeats too little for an n-gram draft to be right)
