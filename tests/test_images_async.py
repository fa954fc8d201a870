"""Images under async scheduling (--async-scheduling): a step with image placeholders runs ahead like any other
(its encoder work goes with the launch; an image's cache entry is let go once the launched step that passed it is
read back), and the greedy ids are HF's — Qwen3.5 VL with mRoPE positions through chunks that cut an image and
through forced preemption, Gemma 3 with its whole-image chunks and key limits."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tiny_models import hf_model
from tiny_vl_models import hf_greedy_mm, make_tiny_gemma3_vl, make_tiny_vl_model, random_image

pytest.importorskip("PIL")
MAX_TOKENS = 10
QWEN = "<|im_start|>user\n{images}{text}<|im_end|>\n<|im_start|>assistant\n"
GEMMA = "<start_of_turn>user\n{images}{text}<end_of_turn>\n<start_of_turn>model\n"
CASES = [("Describe this.", [(56, 84)], [0]), ("Compare the two pictures.", [(100, 40), (30, 30)], [1, 2]),
         ("What is odd here?", [(50, 70)], [3])]


def cases_and_hf(path, template: str, placeholder: str):
    """Each case's processed inputs (by the engine's processor) and HF's greedy ids for it."""
    llm = LLM(str(path), device="cpu", max_num_seqs=4)
    cases = [llm.engine.process_images(template.format(images=placeholder * len(sizes), text=text),
                                       [random_image(w, h, s) for (w, h), s in zip(sizes, seeds)])
             for text, sizes, seeds in CASES]
    hf = hf_model(path)
    return cases, [hf_greedy_mm(hf, inputs, MAX_TOKENS) for inputs in cases]


def run_ahead(llm: LLM, cases) -> tuple[list[list[int]], list[int]]:
    """Every case at once: greedy ids per case, and the images encoded by each step that ran ahead."""
    assert llm.engine.async_scheduling
    seen, launched = [], llm.engine.scheduler.launched
    llm.engine.scheduler.launched = lambda out: seen.append(len(out.encoder.encode)) or launched(out)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ids = []
    for i, inputs in enumerate(cases):
        ids.append(f"a{i}")
        llm.engine.add_request(ids[-1], inputs.prompt_token_ids, params, mm=inputs)
    return [out.outputs[0].token_ids for out in llm._run(ids, use_tqdm=False)], seen


def all_released(llm: LLM) -> bool:
    """Nobody holds an image entry once every request is done."""
    return not any(llm.engine.encoder_cache.holders.values())


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = make_tiny_vl_model(tmp_path_factory.mktemp("qwen3_5-vl"), "qwen3_5-vl")
    return (path, *cases_and_hf(path, QWEN, "<|vision_start|><|image_pad|><|vision_end|>"))


def test_qwen_chunks_cutting_an_image_run_ahead(qwen):
    path, cases, expected = qwen
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=7, max_num_seqs=4, enable_prefix_caching=False,
              async_scheduling=True)
    got, seen = run_ahead(llm, cases)
    assert got == expected
    assert sum(seen) == 4, "every image is encoded by a step that ran ahead"
    assert llm.engine.encoder_cache.num_encoded == 4  # each image once, its chunks launched before the last is read
    assert all_released(llm)


def test_qwen_forced_preemption_runs_ahead(qwen):
    path, cases, expected = qwen
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=16, num_gpu_blocks_override=8, max_num_seqs=3,
              async_scheduling=True)
    got, seen = run_ahead(llm, cases)
    assert got == expected
    assert sum(seen) >= 4 and llm.engine.scheduler.num_preemptions > 0  # re-encoded after a preemption
    assert all_released(llm)


def test_gemma3_whole_images_run_ahead(tmp_path_factory):
    path = make_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl"))
    cases, expected = cases_and_hf(path, GEMMA, "<start_of_image>")
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=8, max_num_seqs=4, async_scheduling=True)
    got, seen = run_ahead(llm, cases)
    assert got == expected
    assert sum(seen) == 4
    assert all_released(llm)
