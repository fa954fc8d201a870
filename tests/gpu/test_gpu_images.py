"""Images on the card: the Triton kernel's key limits (Gemma's bidirectional attention within an image) against the
torch reference in bf16 at Gemma 3's shapes (256-token images, a 1024 window, d128), and each vision-language family
serving images on CUDA with greedy ids identical to HF's on the processor's outputs (float32 weights: the tiny
random models have near-ties in bf16; the tower and the Triton path are what is checked)."""
from __future__ import annotations

import pytest
import torch

from kernels import get_attention_backend
from kernels.image_mask import key_limits_for
from kernels.paged_batch import make_paged_batch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("window", [None, 1024])
def test_triton_key_limits_match_torch_in_bf16(window):
    # a prompt holding two images, a chunk that starts inside an image (a prefix hit mid-image), decodes
    query_lens, seq_lens = [600, 300, 1, 1], [600, 800, 900, 40]
    images = [[(10, 266), (300, 556)], [(480, 736)], [(100, 356)], []]
    batch = make_paged_batch(query_lens, seq_lens, 4, 2, 128, dtype=torch.bfloat16, device="cuda")
    limits = key_limits_for(query_lens, seq_lens, images).cuda()
    outs = []
    for name in ("torch", "triton"):
        write, attend = get_attention_backend(name)
        k, v = batch.k_cache.clone(), batch.v_cache.clone()
        write(batch.new_key, batch.new_value, k, v, batch.slot_mapping, batch.k_scale, batch.v_scale)
        outs.append(attend(batch.query, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                           128 ** -0.5, window, batch.k_scale, batch.v_scale, key_limits=limits).float())
    err = float((outs[0] - outs[1]).abs().max())
    assert err <= 2e-2, f"max |triton - torch| = {err:.3e}"


@pytest.mark.parametrize("family", ["qwen3_5-vl", "gemma3-vl", "mistral3-vl"])
def test_images_on_cuda_match_hf(family, make_llm, tmp_path):
    from tiny_models import hf_model
    from tiny_vl_models import (hf_greedy_mm, make_tiny_gemma3_vl, make_tiny_mistral3_vl, make_tiny_vl_model,
                                random_image)
    makers = {"gemma3-vl": make_tiny_gemma3_vl, "mistral3-vl": make_tiny_mistral3_vl}
    path = makers[family](tmp_path) if family in makers else make_tiny_vl_model(tmp_path, family)
    placeholder = {"qwen3_5-vl": "<|vision_start|><|image_pad|><|vision_end|>", "gemma3-vl": "<start_of_image>",
                   "mistral3-vl": "[IMG]"}[family]
    llm = make_llm(path, dtype="float32", max_num_batched_tokens=64)
    from engine import SamplingParams
    inputs = llm.engine.process_images(f"{placeholder}{placeholder}Compare.", [random_image(100, 40, 1),
                                                                               random_image(56, 84, 2)])
    llm.engine.add_request("gpu-images", inputs.prompt_token_ids, SamplingParams(temperature=0, max_tokens=10),
                           mm=inputs)
    got = llm._run(["gpu-images"], use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy_mm(hf_model(path), inputs, 10)


def test_the_start_profiles_the_largest_image_and_sets_the_encoder_cache_aside(make_llm, tmp_path, monkeypatch,
                                                                              caplog):
    """On a card the KV sizing's profile runs the tower on the largest image the processor accepts (once: one
    rank), and the plan sets the encoder cache aside (engine/planning/vision.py's rule, the planner's)."""
    from engine.models.qwen3_5 import Qwen3_5ForConditionalGeneration
    from tiny_vl_models import make_tiny_vl_model
    patches = []
    encode = Qwen3_5ForConditionalGeneration.encode_image
    monkeypatch.setattr(Qwen3_5ForConditionalGeneration, "encode_image",
                        lambda self, data: patches.append(int(data["image_grid_thw"].prod())) or encode(self, data))
    with caplog.at_level("INFO", logger="pagedesk.engine"):
        llm = make_llm(make_tiny_vl_model(tmp_path, "qwen3_5-vl"), dtype="float32", max_num_batched_tokens=64)
    assert patches == [llm.engine.images.max_embeds * 4]  # 2 x 2 patches per embedding
    assert "encoder cache" in caplog.text
