"""The model registry and ModelConfig's reading of text configs: names without torch, VL checkpoints' text_config,
per-layer kinds, RoPE parameters per layer type, and clear errors for what is not supported."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.config.model import ModelConfig
from engine.models.registry import ARCHITECTURES, SUPPORTED_ARCHITECTURES, model_class

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 256}


def test_names_and_config_reading_import_no_torch():
    code = ("import sys, engine.config.model, engine.models.registry, engine.planning.planner\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print(len(engine.models.registry.SUPPORTED_ARCHITECTURES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(ARCHITECTURES)


def test_every_registered_family_class_exists():
    for name in SUPPORTED_ARCHITECTURES:
        assert callable(model_class(name))


def test_unknown_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM"):
        ModelConfig.from_hf_config({**BASE, "architectures": ["GPT2LMHeadModel"]})


def test_layer_types_from_list_pattern_and_window():
    llama = ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"]})
    assert llama.layer_types == ["full_attention"] * 6 and llama.sliding_windows == [None] * 6
    mistral = ModelConfig.from_hf_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert mistral.layer_types == ["sliding_attention"] * 6 and mistral.sliding_windows == [32] * 6
    listed = ModelConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32,
                                         "layer_types": ["full_attention", "sliding_attention"] * 3})
    assert listed.sliding_windows == [None, 32] * 3
    off = ModelConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32,
                                      "use_sliding_window": False, "layer_types": ["sliding_attention"] * 6})
    assert off.sliding_windows == [None] * 6
    pattern = ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"], "sliding_window": 8,
                                          "sliding_window_pattern": 3})
    assert pattern.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match="layer_types has 2 entries for 6 layers"):
        ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"], "sliding_window": 8,
                                    "layer_types": ["full_attention"] * 2})
    with pytest.raises(ValueError, match="'chunked_attention'"):
        ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"], "sliding_window": 8,
                                    "layer_types": ["chunked_attention"] * 6})


def test_rope_parameters_both_spellings_and_per_layer_type():
    old = ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
                                      "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old.rope_parameters == {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    new = ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"],
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert new.rope_scaling is None and new.rope_theta == 1e4
    per_type = ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"], "sliding_window": 8,
                                           "sliding_window_pattern": 3, "rope_parameters": {
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert per_type.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    assert per_type.rope_parameters["full_attention"]["factor"] == 8.0
    local_base = ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"], "sliding_window": 8,
                                             "sliding_window_pattern": 3, "rope_local_base_freq": 1e4,
                                             "rope_theta": 1e6})
    assert local_base.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert local_base.rope_parameters["full_attention"]["rope_theta"] == 1e6
    mrope = ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"],
                                        "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}})
    assert mrope.rope_parameters["full_attention"]["rope_type"] == "default"
    with pytest.raises(ValueError, match=r"rope type 'su' \(full_attention layers\) is not supported"):
        ModelConfig.from_hf_config({**BASE, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"type": "su"}})


def test_text_config_is_merged_over_the_top_level():
    from engine.config.model import text_config
    hf = {"architectures": ["X"], "eos_token_id": 3, "vision_config": {"hidden_size": 9},
          "text_config": {**BASE, "eos_token_id": [1, 2]}, "quantization_config": {"quant_method": "awq"}}
    text = text_config(hf, {"vocab_size": 7, "rms_norm_eps": 1e-5})
    assert text["eos_token_id"] == [1, 2] and text["hidden_size"] == 64 and text["vocab_size"] == 100
    assert text["rms_norm_eps"] == 1e-5 and "vision_config" not in text and "quantization_config" in text
