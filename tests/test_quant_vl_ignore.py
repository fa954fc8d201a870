"""A quantized vision-language checkpoint whose ignore list names modules the way the VL model spells them
(`model.language_model.layers.0.mlp`, transformers 5's in-memory names, while the tensors on disk are
`language_model.model.*`): those layers load unquantized and the output is HF's on the dequantized weights."""
from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.config.model import ModelConfig, text_module_patterns
from hf_reference import hf_greedy, make_prompts
from quant_packers import dequantized_folder, make_quantized

pytestmark = pytest.mark.timeout(180)


def test_ignore_entries_in_vl_spellings_name_the_text_model():
    given = ("model.language_model.layers.0.mlp", "language_model.model.layers.1.self_attn", "language_model.lm_head",
             r"re:model\.language_model\.layers\.\d+\.mlp\.down_proj", "model.vision_tower")
    patterns = text_module_patterns(given)
    assert patterns[:len(given)] == given  # kept as given
    assert set(patterns[len(given):]) == {"model.layers.0.mlp", "model.layers.1.self_attn", "lm_head",
                                          r"re:model\.layers\.\d+\.mlp\.down_proj"}


def test_awq_gemma3_vl_with_an_unquantized_mlp_matches_hf(tiny_model_dir, tmp_path):
    src = tiny_model_dir("gemma3-vl")
    mlp = "language_model.model.layers.0.mlp"
    packed = make_quantized(src, tmp_path / "packed", "awq", 4, 32,
                            ignore=tuple(f"{mlp}.{p}" for p in ("gate_proj", "up_proj", "down_proj")))
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["model.language_model.layers.0.mlp",
                                                               "model.vision_tower", "lm_head"]
    (packed / "config.json").write_text(json.dumps(config))
    quant = ModelConfig.from_folder(packed).quantization
    assert quant.is_ignored("model.layers.0.mlp.gate_proj") and not quant.is_ignored("model.layers.1.mlp.up_proj")

    prompts = [make_prompts(400)[i] for i in (1, 4)]
    expected = hf_greedy(dequantized_folder(packed, tmp_path / "float"), prompts, [8, 8])
    llm = LLM(str(packed), device="cpu")
    layers = llm.engine.runner.model.model.layers
    assert type(layers[0].mlp.gate_up_proj.method).__name__ == "UnquantizedLinearMethod"
    assert type(layers[1].mlp.gate_up_proj.method).__name__ != "UnquantizedLinearMethod"
    got = [o.outputs[0].token_ids for o in
           llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=8)] * 2, use_tqdm=False)]
    assert got == expected
