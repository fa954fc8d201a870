"""The Gemma 3 family: Gemma3ForCausalLM (1B text) and Gemma3ForConditionalGeneration (4B/12B/27B, images in).

The shared decoder with Gemma's switches: (1 + w) RMSNorms, four per layer (before and after attention and the
MLP), the token embedding scaled by sqrt(hidden_size), q/k norms, attention scaled by query_pre_attn_scalar, a
GELU-tanh MLP (hidden_activation) and two RoPE tables — local layers (sliding window, 5 of every 6) on their own
base, global ones on the scaled long-context base. A final soft cap on the logits where the config has one. A VL
checkpoint keeps the text model under `language_model`; with its image processor beside it (ModelConfig.vision)
the SigLIP tower and projector load too (engine/models/gemma3_vision.py) and an image's tokens attend to each
other both ways (the scheduler's key limits); without one the mapper skips them on purpose, never loaded. Gemma 2 (engine/models/gemma2.py) is this decoder without the
q/k norms and with soft-capped attention logits, both read from the config here.
"""
from __future__ import annotations

import torch

from engine.config.model import ModelConfig
from engine.layers.attention_block import AttentionSwitches
from engine.layers.decoder import DecoderSwitches, GatedMLP
from engine.layers.norm import GemmaRMSNorm
from engine.models.gemma3_vision import Gemma3Projector, SiglipVisionModel
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import VL_TEXT_PREFIXES
from engine.models.weights import LLAMA_GGUF_BLOCK, VL_TEXT_MAPPER, GgufNames, WeightsMapper

# Images in: the tower and projector load under their own names (hub files nest SigLIP in `vision_model.`,
# transformers 5 in memory nests both in `model.`).
VL_MAPPER = WeightsMapper(renamed_prefixes=VL_TEXT_PREFIXES + (
    ("model.vision_tower.vision_model.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector.")))

# llama.cpp's Gemma block: its four norms, each stored as 1 + w
GEMMA_GGUF_NAMES = GgufNames({**LLAMA_GGUF_BLOCK, "post_attention_norm": "post_attention_layernorm",
                              "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
                             norm_offset=1.0)


def check_supported(cfg: ModelConfig) -> None:
    text = cfg.hf_text_config
    if text.get("use_bidirectional_attention"):
        raise ValueError(f"{cfg.architecture}: use_bidirectional_attention (an embedding model) is not supported")
    if cfg.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"{cfg.architecture}: hidden_activation {cfg.hidden_act!r} is not supported "
                         "(gelu_pytorch_tanh only)")


class Gemma3ForCausalLM(LlamaForCausalLM):
    mlp_factory = GatedMLP
    gguf_names = {"gemma3": GEMMA_GGUF_NAMES, "gemma2": GEMMA_GGUF_NAMES}
    check_supported = staticmethod(check_supported)  # Gemma 4 has its own (it takes "vision" bidirectional)

    @staticmethod
    def decoder_switches(cfg: ModelConfig) -> DecoderSwitches:
        text = cfg.hf_text_config
        attention = AttentionSwitches(
            qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=GemmaRMSNorm if cfg.qk_norm else None,  # not Gemma 2
            scale=float(text.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5,
            soft_cap=text.get("attn_logit_softcapping"))
        return DecoderSwitches(attention, norm=GemmaRMSNorm, sandwich_norms=True, embed_scale=cfg.hidden_size ** 0.5)

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        self.check_supported(cfg)
        super().__init__(cfg, backend)
        self.final_softcap = cfg.hf_text_config.get("final_logit_softcapping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The VL checkpoint: the same decoder, plus the tower and projector when it takes images."""

    weights_mapper = VL_TEXT_MAPPER

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        super().__init__(cfg, backend)
        if cfg.vision is not None:
            self.weights_mapper = VL_MAPPER
            self.vision_tower = SiglipVisionModel(cfg.vision.tower)
            self.multi_modal_projector = Gemma3Projector(cfg.vision.tower, cfg.hidden_size,
                                                         cfg.vision.tokens_per_image)

    def encode_image(self, data: dict) -> torch.Tensor:
        pixels = data["pixel_values"]
        if len(pixels) != 1:  # pan-and-scan crops: one image, several pixel squares
            raise ValueError(f"an image became {len(pixels)} crops (the image processor's do_pan_and_scan): "
                             "not supported; set do_pan_and_scan false in preprocessor_config.json")
        weight = self.multi_modal_projector.mm_input_projection_weight
        return self.multi_modal_projector(self.vision_tower(pixels.to(weight.device)))
