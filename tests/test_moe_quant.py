"""Quantized MoE checkpoints (AWQ and GPTQ experts, packed by the tests' own packers) equal HF running the
dequantized float model: greedy token ids identical. The router stays float, as published checkpoints keep it."""
from __future__ import annotations

import pytest
from safetensors import safe_open

from hf_reference import engine_greedy, hf_greedy, make_prompts
from quant_packers import dequantized_folder, make_quantized

PICKS, MAX_TOKENS = [1, 4, 6], [10, 6, 8]


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_quantized_experts_match_hf_on_the_dequantized_model(tiny_model_dir, tmp_path, fmt):
    packed = make_quantized(tiny_model_dir("qwen3_moe"), tmp_path / fmt, fmt, bits=4, group=32)
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.qweight" in names and "model.layers.0.mlp.gate.weight" in names
    prompts = [make_prompts(400)[i] for i in PICKS]
    expected = hf_greedy(dequantized_folder(packed, tmp_path / f"{fmt}-float"), prompts, MAX_TOKENS)
    assert engine_greedy(packed, prompts, MAX_TOKENS) == expected
