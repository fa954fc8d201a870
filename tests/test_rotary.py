"""The RoPE factory against transformers: inverse frequencies and attention factors from ROPE_INIT_FUNCTIONS, and
rotated q/k from each family's own rotary module and apply function, for every supported type."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.layers.rotary import get_rope, rope_inv_freq, rotary_embeddings
from engine.config.model import ModelConfig

SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=64,
             num_hidden_layers=1, vocab_size=32, max_position_embeddings=1024)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                    "mscale_all_dim": 0.707, "original_max_position_embeddings": 64, "truncate": False},
}


def hf_config(model_type: str, rope: dict, **extra):
    return AutoConfig.for_model(model_type, **SHAPE, rope_parameters=dict(rope), **extra)


def ours(config, max_model_len=None):
    cfg = ModelConfig.from_hf_config({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    return cfg.with_max_model_len(max_model_len), cfg.rope_parameters["full_attention"]


def hf_rotate(rotary, apply, q, k, positions):
    cos, sin = rotary(q, positions[None])
    q_hf, k_hf = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


@pytest.mark.parametrize("name", list(ROPES))
def test_inv_freq_and_rotation_match_hf(name):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    config = hf_config("llama", ROPES[name])
    cfg, params = ours(config)
    rope_type = params["rope_type"]
    init = ROPE_INIT_FUNCTIONS.get(rope_type, LlamaRotaryEmbedding.compute_default_rope_parameters)
    hf_inv, hf_factor = init(config, device="cpu")
    inv, factor = rope_inv_freq(params, 64, cfg.max_position_embeddings, cfg.max_model_len)
    torch.testing.assert_close(inv, hf_inv.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(hf_factor)
    torch.manual_seed(0)
    q, k = torch.randn(12, 2, 64), torch.randn(12, 1, 64)
    positions = torch.tensor([0, 1, 2, 5, 63, 64, 65, 127, 200, 511, 700, 1023])
    got = rotary_embeddings(cfg)["full_attention"](positions, q, k)
    want = hf_rotate(LlamaRotaryEmbedding(config), apply_rotary_pos_emb, q, k, positions)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_model_len,positions", [(64, [0, 3, 17, 63]), (1024, [0, 3, 63, 64, 500, 1023])])
def test_longrope_with_partial_rotary_matches_phi3(max_model_len, positions):
    """Short factors while max_model_len stays in the original context, long ones past it: HF's choice for a
    sequence whose length is past it (the HF forward here spans position 1023, or stays under 64)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb
    dim = 48  # partial_rotary_factor 0.75 of 64
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.05 * i for i in range(dim // 2)],
            "long_factor": [1.0 + 0.5 * i for i in range(dim // 2)], "partial_rotary_factor": 0.75}
    config = hf_config("phi3", rope, original_max_position_embeddings=64)
    cfg, params = ours(config, max_model_len)
    assert params["partial_rotary_factor"] == 0.75
    seq_len = max(positions) + 1
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    inv, factor = rope_inv_freq(params, dim, cfg.max_position_embeddings, cfg.max_model_len)
    torch.testing.assert_close(inv, hf_inv, rtol=1e-6, atol=0)
    assert factor == pytest.approx(hf_factor) and factor > 1
    torch.manual_seed(1)
    q, k = torch.randn(len(positions), 2, 64), torch.randn(len(positions), 1, 64)
    pos = torch.tensor(positions)
    got = rotary_embeddings(cfg)["full_attention"](pos, q, k)
    want = hf_rotate(Phi3RotaryEmbedding(config), apply_rotary_pos_emb, q, k, pos)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a[..., dim:], b[..., dim:])  # the unrotated quarter passes through


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5_text"])
def test_mrope_with_text_positions_is_the_plain_table(family):
    """Qwen2-VL's sectioned and Qwen3.5's interleaved mRoPE (with its partial rotary) on text: t = h = w."""
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (Qwen2VLRotaryEmbedding as Rotary,
                                                                    apply_rotary_pos_emb as apply)
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}
        family = "qwen2_vl_text"
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5TextRotaryEmbedding as Rotary,
                                                                  apply_rotary_pos_emb as apply)
        rope = {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                "partial_rotary_factor": 0.25}
    config = AutoConfig.for_model(family, **SHAPE, rope_parameters=dict(rope))
    cfg, params = ours(config)
    torch.manual_seed(2)
    q, k = torch.randn(5, 2, 64), torch.randn(5, 1, 64)
    pos = torch.tensor([0, 1, 9, 100, 1000])
    cos, sin = Rotary(config)(q, pos[None, None].expand(3, 1, -1))
    q_hf, k_hf = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got = rotary_embeddings(cfg)["full_attention"](pos, q, k)
    for a, b in zip(got, (q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_local_and_global_tables_are_built_once_each():
    config = {**SHAPE, "architectures": ["LlamaForCausalLM"], "sliding_window": 16, "sliding_window_pattern": 3,
              "rope_theta": 1e6, "rope_local_base_freq": 1e4, "num_hidden_layers": 6}
    tables = rotary_embeddings(ModelConfig.from_hf_config(config))
    assert tables["full_attention"] is not tables["sliding_attention"]
    one = rotary_embeddings(ModelConfig.from_hf_config({**config, "rope_local_base_freq": 1e6}))
    assert one["full_attention"] is one["sliding_attention"]


def test_unsupported_type_is_named():
    with pytest.raises(ValueError, match="rope type 'axial' is not supported"):
        get_rope(64, 16, {"rope_type": "axial", "rope_theta": 1e4})
