"""Gemma 4 serving images on CUDA: its tower in the encoder step, the key limits on the sliding layers only (the
Triton path), greedy ids equal to HF's on CPU (skipped without a GPU; not yet run on one)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_gemma4_images_on_cuda_match_hf(make_llm, tmp_path):
    from engine import SamplingParams
    from image_families import gemma4_prompt as prompt
    from tiny_vl_models import hf_greedy_mm as hf_greedy, make_tiny_gemma4_vl
    from tiny_models import hf_model
    from tiny_vl_models import random_image
    path = make_tiny_gemma4_vl(tmp_path)
    llm = make_llm(path, dtype="float32", max_num_batched_tokens=96)
    inputs = llm.engine.process_images(prompt("Compare.", 2), [random_image(100, 40, 1), random_image(56, 84, 2)])
    llm.engine.add_request("gpu-gemma4-images", inputs.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=10), mm=inputs)
    got = llm._run(["gpu-gemma4-images"], use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(hf_model(path), inputs, 10)
