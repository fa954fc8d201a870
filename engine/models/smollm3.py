"""SmolLM3 (SmolLM3ForCausalLM): the Llama block with NoPE layers.

`no_rope_layers[i] == 0` makes layer i attend without rotary positions (HF's default: every fourth layer, from
`no_rope_layer_interval`); the others are Llama's. attention_bias covers o_proj too, as in HF.
"""
from __future__ import annotations

from torch import nn

from engine.config.model import ModelConfig
from engine.layers.attention_block import AttentionSwitches, SelfAttention
from engine.layers.decoder import DecoderSwitches
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaForCausalLM


def uses_rope(cfg: ModelConfig, layer: int) -> bool:
    text = cfg.hf_text_config
    interval = text.get("no_rope_layer_interval", 4)
    return bool((text.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(cfg.num_layers)])[layer])


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def decoder_switches(cfg: ModelConfig) -> DecoderSwitches:
        return DecoderSwitches(AttentionSwitches(qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias))

    def token_mixer(self, cfg: ModelConfig, layer: int, ropes: dict[str, RotaryEmbedding], backend: str) -> nn.Module:
        rope = ropes[cfg.layer_types[layer]] if uses_rope(cfg, layer) else None
        return SelfAttention(cfg, layer, self.switches.attention, rope, backend, self.packed_modules_mapping)
