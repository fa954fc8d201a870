"""Images into Qwen3.5 VL (dense and MoE), what only Qwen has beside the shared tests (tests/test_images_families.py:
HF parity for one image, two images and an odd size, chunked prefill cutting an image, prefix caching, forced
preemption, n > 1, TP=2): the offline API's shapes (`multi_modal_data`, `LLM.chat` image parts), bad inputs as
errors, and speculative verify over mRoPE positions."""
from __future__ import annotations

import base64
import io

import pytest

from engine import LLM, SamplingParams
from image_families import MAX_TOKENS, first_ids, qwen_prompt as prompt
from tiny_vl_models import random_image

pytest.importorskip("PIL")


@pytest.fixture(scope="module", params=["qwen3_5-vl", "qwen3_5_moe-vl"])
def family(request, image_family):
    """(model path, engine, processor inputs per case, HF's greedy ids per case)."""
    built = image_family(request.param)
    return built.path, built.llm, built.cases, built.expected


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
    assert first_ids(llm, cases[:1]) == expected[:1]  # and it keeps serving


def test_speculative_verify_keeps_mrope_positions(family):
    """n-gram drafts verified over an image prompt: the verify rows continue the prompt's mRoPE positions (index +
    delta past the image), so drafts are accepted and the ids are the plain engine's (HF's, above)."""
    path, llm, cases, expected = family
    spec = LLM(str(path), device="cpu", max_num_seqs=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                   "prompt_lookup_min": 1})
    assert first_ids(spec, cases) == expected
    request = {"prompt": prompt("Describe this.", 1), "multi_modal_data": {"image": random_image(56, 84, 0)}}
    params = SamplingParams(temperature=0, max_tokens=30)
    assert spec.generate([request], params, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate([request], params, use_tqdm=False)[0].outputs[0].token_ids
    stats = spec.engine.spec.stats
    assert stats.num_draft_tokens > 0
    if path.name == "tiny-qwen3_5-vl":  # its reply repeats itself: right drafts, kept only at the right positions
        assert stats.num_accepted_tokens > 0  # (the MoE's repeats too little for an n-gram draft to be right)
