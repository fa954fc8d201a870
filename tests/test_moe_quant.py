"""Quantized MoE checkpoints (AWQ, GPTQ, AutoRound and compressed-tensors experts, packed by the tests' own
packers) equal HF running the dequantized float model: greedy token ids identical. The router stays float, as
published checkpoints keep it (AutoRound lists it in extra_config as 16-bit)."""
from __future__ import annotations

import pytest
import torch
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


@pytest.mark.parametrize("fmt", ["awq", "gptq-8bit", "ct", "mxfp4"])
def test_planner_counts_exactly_the_packed_experts_loaded(tiny_model_dir, tmp_path, fmt):
    """The planner's bytes equal the loaded parameters and buffers: experts stay packed in memory (int32 words,
    float16 scales and a byte per 4-bit zero point, int16 per 8-bit; compressed-tensors' float32 scales and its
    implied zero points; MXFP4 bytes and E8M0 scales), attention and routers as the checkpoint keeps them."""
    from engine.loader import iterate_weights
    from engine.model_config import ModelConfig
    from engine.models.registry import model_class
    from engine.sizing import weights_bytes_per_card
    from quant_packers import make_mxfp4_gpt_oss
    if fmt == "mxfp4":
        path = make_mxfp4_gpt_oss(tiny_model_dir("gpt_oss"), tmp_path / fmt)
    else:
        path = make_quantized(tiny_model_dir("qwen3_moe"), tmp_path / fmt, "gptq" if fmt == "gptq-8bit" else fmt,
                              bits=8 if fmt == "gptq-8bit" else 4, group=32, sym=fmt == "ct")
    cfg = ModelConfig.from_folder(path)
    model = model_class(cfg.architecture)(cfg)
    model.load_weights(iterate_weights(path))
    experts = model.model.layers[0].mlp.experts
    packed = {n: t.dtype for n, t in [*experts.named_buffers(), *experts.named_parameters()]}
    if fmt == "mxfp4":
        assert packed["w13_blocks"] == packed["w2_scales"] == torch.uint8
    else:
        assert packed[f"w13_{'weight_packed' if fmt == 'ct' else 'qweight'}"] == torch.int32
    # buffers: compressed-tensors' implied zero points count; RoPE tables are rope_table_bytes, not weights
    buffers = [b for name, b in model.named_buffers() if "rotary" not in name and "rope" not in name]
    loaded = sum(t.numel() * t.element_size() for t in [*model.parameters(), *buffers])
    assert weights_bytes_per_card(cfg, 4) == loaded
