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
