"""gpt-oss's attention half against HF's GptOssAttention on the same weights: sinks, the alternating 8-token
window, YaRN RoPE, q/k/v/o biases, the checkpoint's own tensor names.

One sequence goes through our GptOssAttention step by step as the engine would run it (two prefill chunks,
then decodes) over a paged cache of 4-token blocks, so windows span several blocks; HF's eager attention runs
the whole sequence at once with its causal / sliding mask. The experts are not part of this (the MoE family
plugs its MLP into the shared DecoderLayer), so the architecture is registered only inside these tests.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.layers.attention import AttentionMetadata
from engine.layers.rotary import rotary_embeddings
from engine.config.model import ModelConfig
from engine.models import registry
from engine.models.gpt_oss import GptOssAttention
from engine.models.weights import PACKED_QKV_GATE_UP, load_weights

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
STEPS = [(0, 11), (11, 17)] + [(t, t + 1) for t in range(17, 24)]  # chunks, then decodes: 24 tokens
BLOCK_SIZE = 4


@pytest.fixture
def hf_config(monkeypatch):
    from transformers import GptOssConfig
    monkeypatch.setitem(registry.ARCHITECTURES, "GptOssForCausalLM",
                        registry.Architecture("gpt_oss", "GptOssForCausalLM", o_proj_bias=True))
    config = GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_hidden_layers=2, intermediate_size=32, num_local_experts=2, vocab_size=100,
                          sliding_window=8, max_position_embeddings=2048, rope_parameters=dict(YARN),
                          attention_bias=True)
    config.architectures = ["GptOssForCausalLM"]
    config._attn_implementation = "eager"
    return config


def hf_attention(config, layer: int):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention as HFAttention
    torch.manual_seed(layer)
    module = HFAttention(config, layer).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (2.0 if p.dim() == 1 else 0.2))  # biases and sinks of weight
    return module


def hf_output(config, module, x: torch.Tensor) -> torch.Tensor:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    tokens = x.shape[0]
    positions = torch.arange(tokens)[None]
    cos, sin = GptOssRotaryEmbedding(config)(x[None], positions)
    q_idx, kv_idx = torch.arange(tokens)[:, None], torch.arange(tokens)[None, :]
    allowed = kv_idx <= q_idx
    if module.sliding_window:
        allowed &= kv_idx > q_idx - module.sliding_window
    mask = torch.zeros(tokens, tokens).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        out, _ = module(x[None], (cos, sin), mask)
    return out[0]


class Holder(nn.Module):
    """Gives our module the checkpoint's `self_attn.` prefix, so load_weights routes real names."""

    def __init__(self, attention: GptOssAttention) -> None:
        super().__init__()
        self.self_attn = attention


def our_output(cfg: ModelConfig, layer: int, hf_module, x: torch.Tensor) -> torch.Tensor:
    rope = rotary_embeddings(cfg)[cfg.layer_types[layer]]
    holder = Holder(GptOssAttention(cfg, layer, "torch", rope, PACKED_QKV_GATE_UP))
    load_weights(holder, ((f"self_attn.{k}", v) for k, v in hf_module.state_dict().items()),
                 packed_modules_mapping=PACKED_QKV_GATE_UP)
    attention = holder.self_attn
    num_blocks = -(-x.shape[0] // BLOCK_SIZE)
    k_cache = torch.zeros(num_blocks + 2, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    v_cache = torch.zeros_like(k_cache)
    attention.attn.bind_cache(k_cache, v_cache)
    block_table = torch.randperm(num_blocks + 2)[:num_blocks].to(torch.int32)  # shuffled physical blocks
    outs = []
    for start, end in STEPS:
        pos = torch.arange(start, end)
        slots = block_table[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        meta = AttentionMetadata(slots, block_table[None], torch.tensor([end], dtype=torch.int32),
                                 torch.tensor([0, end - start], dtype=torch.int32), end - start, end)
        with torch.no_grad():
            outs.append(attention(pos, x[start:end], meta))
    return torch.cat(outs)


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding-window-layer", "global-layer"])
def test_attention_matches_hf_gpt_oss_attention(hf_config, layer):
    cfg = ModelConfig.from_hf_config(hf_config.to_dict())
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_windows == [8, None]
    assert cfg.rope_parameters["full_attention"]["rope_type"] == "yarn"
    hf_module = hf_attention(hf_config, layer)
    assert hf_module.sliding_window == cfg.sliding_windows[layer]
    x = torch.randn(STEPS[-1][1], 64)
    torch.testing.assert_close(our_output(cfg, layer, hf_module, x), hf_output(hf_config, hf_module, x),
                               atol=1e-5, rtol=1e-5)


def test_sinks_matter_here(hf_config):
    """Guard: with the sinks at -inf (no sink) HF's output moves, so the test above checks them."""
    module = hf_attention(hf_config, 0)
    x = torch.randn(12, 64)
    with_sinks = hf_output(hf_config, module, x)
    with torch.no_grad():
        module.sinks.fill_(-float("inf"))
    assert float((with_sinks - hf_output(hf_config, module, x)).abs().max()) > 0.05


def test_checkpoint_without_sinks_is_an_error_naming_them(hf_config):
    cfg = ModelConfig.from_hf_config(hf_config.to_dict())
    holder = Holder(GptOssAttention(cfg, 0, "torch", rotary_embeddings(cfg)["sliding_attention"],
                                    PACKED_QKV_GATE_UP))
    weights = {f"self_attn.{k}": v for k, v in hf_attention(hf_config, 0).state_dict().items() if k != "sinks"}
    with pytest.raises(ValueError, match="self_attn.sinks"):
        load_weights(holder, weights.items(), packed_modules_mapping=PACKED_QKV_GATE_UP)
