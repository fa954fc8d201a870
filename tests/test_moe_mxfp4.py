"""gpt-oss in its published MXFP4 form (expert `*_blocks`/`*_scales`, written on the fly by the tests' own packer
from the OCP Microscaling spec) equals HF transformers running the same folder dequantized by its own MXFP4
integration (Mxfp4Config(dequantize=True)): greedy token ids identical. The experts stay packed in the engine
(uint8 parameters); the CPU path dequantizes each routed expert, the CUDA path inside the fused kernel."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Mxfp4Config

from hf_reference import engine_greedy, make_prompts
from quant_packers import make_mxfp4_gpt_oss

PICKS, MAX_TOKENS = [1, 4, 6], [10, 6, 8]


def hf_dequantized_greedy(path, prompts, max_tokens):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    outs = []
    for prompt, n in zip(prompts, max_tokens):
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        outs.append(ids[0, len(prompt):].tolist())
    return outs


def test_mxfp4_gpt_oss_matches_hf_dequantized(tiny_model_dir, tmp_path):
    packed = make_mxfp4_gpt_oss(tiny_model_dir("gpt_oss"), tmp_path / "mxfp4")
    prompts = [make_prompts(400)[i] for i in PICKS]
    expected = hf_dequantized_greedy(packed, prompts, MAX_TOKENS)
    assert engine_greedy(packed, prompts, MAX_TOKENS) == expected


def test_mxfp4_experts_refuse_what_they_cannot_hold():
    """Input features that are not whole 32-value blocks, and blocks that are not bytes, are named."""
    import pytest

    from engine.layers.fused_moe import FusedMoE
    from engine.quantization.config import parse_quantization_config
    quant = parse_quantization_config({"quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ValueError, match="w2 has 48 input features per rank, not whole MXFP4 blocks of 32"):
        FusedMoE(4, 64, 48, "swigluoai", True, "model.layers.0.mlp.experts", quant)
    moe = FusedMoE(4, 64, 32, "swigluoai", True, "model.layers.0.mlp.experts", quant)
    assert moe.w13_blocks.shape == (4, 64, 32) and moe.w2_scales.shape == (4, 64, 1)
    with pytest.raises(ValueError, match="MXFP4 expert blocks w1 has dtype torch.int8, expected uint8"):
        moe.weight_loader(moe.w13_blocks, torch.zeros(32, 32, dtype=torch.int8), "w1", 0)
