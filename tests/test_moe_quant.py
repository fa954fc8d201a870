"""Quantized MoE checkpoints (AWQ, GPTQ, AutoRound and compressed-tensors experts, packed by the tests' own
packers) equal HF running the dequantized float model: greedy token ids identical. The router stays float, as
published checkpoints keep it (AutoRound lists it in extra_config as 16-bit)."""
from __future__ import annotations

import pytest
from safetensors import safe_open

from hf_reference import engine_greedy, hf_greedy, make_prompts
from quant_packers import dequantized_folder, make_quantized

PICKS, MAX_TOKENS = [1, 4, 6], [10, 6, 8]


EXPERT_LEAF = {"awq": "qweight", "gptq": "qweight", "auto-round": "qweight", "ct": "weight_packed"}


@pytest.mark.parametrize("fmt,sym", [("awq", False), ("gptq", False), ("auto-round", True), ("ct", True)])
def test_quantized_experts_match_hf_on_the_dequantized_model(tiny_model_dir, tmp_path, fmt, sym):
    packed = make_quantized(tiny_model_dir("qwen3_moe"), tmp_path / fmt, fmt, bits=4, group=32, sym=sym)
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert f"model.layers.0.mlp.experts.3.down_proj.{EXPERT_LEAF[fmt]}" in names
    assert "model.layers.0.mlp.gate.weight" in names
    prompts = [make_prompts(400)[i] for i in PICKS]
    expected = hf_greedy(dequantized_folder(packed, tmp_path / f"{fmt}-float"), prompts, MAX_TOKENS)
    assert engine_greedy(packed, prompts, MAX_TOKENS) == expected
