"""Images into Qwen3-VL (dense): greedy ids identical to HF `generate` on the same processor outputs for one image
and two images, under chunked prefill that cuts an image (DeepStack's features reach the rows each chunk holds);
the tower's DeepStack sets ride beside the main embeddings, and the planner counts their mergers and cache."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config.model import ModelConfig
from engine.planning.vision import encoder_cache_bytes, tower_params
from tiny_models import hf_model
from tiny_vl_models import hf_greedy_mm, make_tiny_vl_model, random_image

pytest.importorskip("PIL")
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 10
CASES = [("Describe this.", [(56, 84)], [0]), ("Compare the two pictures.", [(448, 448), (84, 56)], [1, 2])]


def prompt(text: str, images: int) -> str:
    return f"<|im_start|>user\n{PLACEHOLDER * images}{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    path = make_tiny_vl_model(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl")
    llm = LLM(str(path), device="cpu", max_num_seqs=4)
    cases = [llm.engine.process_images(prompt(text, len(sizes)), [random_image(w, h, s) for (w, h), s in
                                                                  zip(sizes, seeds)])
             for text, sizes, seeds in CASES]
    hf = hf_model(path)
    return path, llm, cases, [hf_greedy_mm(hf, inputs, MAX_TOKENS) for inputs in cases]


def run(llm, cases):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ids = []
    for i, inputs in enumerate(cases):
        request_id = f"q3vl-{id(llm)}-{i}"
        llm.engine.add_request(request_id, inputs.prompt_token_ids, params, mm=inputs)
        ids.append(request_id)
    return [out.outputs[0].token_ids for out in llm._run(ids, use_tqdm=False)]


def test_greedy_matches_hf(family):
    _, llm, cases, expected = family
    assert run(llm, cases) == expected
    assert [len(c.items) for c in cases] == [1, 2]


def test_chunked_prefill_cutting_an_image(family):
    path, _, cases, expected = family
    small = LLM(str(path), device="cpu", max_num_batched_tokens=7, max_num_seqs=4, enable_prefix_caching=False)
    assert run(small, cases) == expected
    assert small.engine.encoder_cache.num_encoded == 3


def test_deepstack_rides_beside_the_embeddings_and_is_counted(family):
    path, llm, cases, _ = family
    model, cfg = llm.engine.runner.model, ModelConfig.from_folder(path)
    embeds = model.encode_image(cases[0].items[0].data)
    assert cfg.vision.num_deepstack == 2 and embeds.shape == (cases[0].items[0].num_embeds, 3 * cfg.hidden_size)
    assert embeds[:, cfg.hidden_size:].abs().sum() > 0
    tower = sum(p.numel() for name, p in model.named_parameters() if name.startswith("visual."))
    assert tower_params(cfg.vision, cfg.hidden_size) == tower
    assert encoder_cache_bytes(cfg, 64, 4, 16) == 2 * 64 * 3 * cfg.hidden_size * 4


def test_qwen3_vl_moe_is_refused_by_name():
    from engine.models.registry import get_architecture
    with pytest.raises(ValueError, match="Qwen3-VL-MoE is not built: .*fused 3-D tensors"):
        get_architecture("Qwen3VLMoeForConditionalGeneration")
