"""The Llama family: Llama, Qwen2, Qwen3 and Mistral (and Mistral3's text model), and the base every family builds on.

The Llama block is the shared decoder (engine/layers/decoder.py, engine/layers/attention_block.py) with the
switches read from ModelConfig here: QKV bias (Qwen2), q/k RMSNorm (Qwen3); tied embeddings, explicit head_dim,
RoPE scaling and per-layer sliding windows (Mistral) come with the config. `LlamaForCausalLM` is also the base
the other families subclass: a family changes its switches (`decoder_switches`), what a layer mixes tokens with
(`token_mixer`), its MLP (`mlp_factory`) or the whole layer stack (`decoder_layers`), and its checkpoint names
(`packed_modules_mapping`, `weights_mapper`, and `gguf_names` per GGUF architecture it serves). Weights stream straight from safetensors into these modules through
each parameter's weight_loader (engine/models/weights.py); quantized checkpoints load the same way.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from engine.config.model import ModelConfig
from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.attention_block import AttentionSwitches, SelfAttention
from engine.layers.decoder import DecoderLayer, DecoderModel, DecoderSwitches, GatedMLP
from engine.layers.embedding import ParallelLMHead
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rotary_embeddings
from engine.models.registry import VL_TEXT_PREFIXES
from engine.models.weights import (LLAMA_GGUF_BLOCK, LLAMA_GGUF_NAMES, PACKED_QKV_GATE_UP, VL_TEXT_MAPPER,
                                   GgufNames, WeightsMapper, load_weights)
from engine.quantization.gguf.types import is_gguf_model


class LlamaMLP(GatedMLP):
    """The Llama family's dense MLP (the MoE and hybrid families' dense layers too)."""


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = PACKED_QKV_GATE_UP
    weights_mapper = WeightsMapper()
    # GGUF architecture -> its tensor names (llama.cpp permutes Llama's q/k rows, not Qwen's)
    gguf_names = {"llama": GgufNames(LLAMA_GGUF_BLOCK, permuted_qk=True), "qwen2": LLAMA_GGUF_NAMES,
                  "qwen3": LLAMA_GGUF_NAMES, "mistral3": GgufNames(LLAMA_GGUF_BLOCK, permuted_qk=True)}
    mlp_factory = LlamaMLP  # (cfg, layer, packed) -> the layer's MLP; MoE families put their experts here
    model_class = DecoderModel

    @staticmethod
    def decoder_switches(cfg: ModelConfig) -> DecoderSwitches:
        return DecoderSwitches(AttentionSwitches(qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                                                 qk_norm=RMSNorm if cfg.qk_norm else None))

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        super().__init__()
        self.config = cfg
        self.switches = self.decoder_switches(cfg)
        self.model = self.model_class(cfg, self.switches, self.decoder_layers(cfg, backend))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, gguf=is_gguf_model(cfg))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def decoder_layers(self, cfg: ModelConfig, backend: str) -> Iterator[nn.Module]:
        ropes = rotary_embeddings(cfg)  # one table per RoPE kind, shared by that kind's layers
        for layer in range(cfg.num_layers):
            mixer = self.token_mixer(cfg, layer, ropes, backend)
            yield DecoderLayer(cfg, self.switches, mixer,
                               type(self).mlp_factory(cfg, layer, self.packed_modules_mapping))

    def token_mixer(self, cfg: ModelConfig, layer: int, ropes: dict[str, RotaryEmbedding],
                    backend: str) -> nn.Module:
        return SelfAttention(cfg, layer, self.switches.attention, ropes[cfg.layer_types[layer]], backend,
                             self.packed_modules_mapping)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if mm_embeds is None:  # the text path keeps its call (graphs trace it)
            return self.model(input_ids, positions, meta)
        return self.model(input_ids, positions, meta, mm_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        """The attention layers, in order: the KV cache groups number these (engine/kv/kv_cache_interface.py)."""
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    def state_layers(self) -> list[GatedDeltaNet]:
        """A hybrid model's linear-attention layers, in order: each gets its slice of the state pool."""
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, weights, packed_modules_mapping=self.packed_modules_mapping, mapper=self.weights_mapper,
                     quant=self.config.quantization, tied_lm_head=self.config.tie_word_embeddings)


# Mistral3 with images in: the Pixtral tower and projector load under their own names (engine/models/pixtral_vision.py).
MISTRAL3_VL_MAPPER = WeightsMapper(renamed_prefixes=VL_TEXT_PREFIXES + (
    ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector.")))


class Mistral3ForConditionalGeneration(LlamaForCausalLM):
    """Mistral-Small-3.x, Magistral, Devstral: a Mistral text model under a Pixtral tower. With its image processor
    beside it (ModelConfig.vision) the tower and projector load and take images; without one it is served as text."""

    weights_mapper = VL_TEXT_MAPPER

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        super().__init__(cfg, backend)
        if cfg.vision is None:
            return
        from engine.models.pixtral_vision import Mistral3Projector, PixtralVisionModel
        hf = cfg.vision.projector
        if hf.get("vision_feature_layer", -1) not in (-1, [-1]) or hf.get("projector_hidden_act", "gelu") != "gelu":
            raise ValueError(f"{cfg.architecture}: vision_feature_layer {hf.get('vision_feature_layer')} / "
                             f"projector_hidden_act {hf.get('projector_hidden_act')!r} are not supported (-1, gelu)")
        self.weights_mapper = MISTRAL3_VL_MAPPER
        self.vision_tower = PixtralVisionModel(cfg.vision.tower)
        self.multi_modal_projector = Mistral3Projector(cfg.vision.tower, cfg.hidden_size,
                                                       cfg.vision.spatial_merge_size, cfg.rms_norm_eps,
                                                       bool(hf.get("multimodal_projector_bias", False)))

    def encode_image(self, data: dict) -> torch.Tensor:
        height, width = (int(x) for x in data["image_sizes"][0])
        pixels = data["pixel_values"].to(self.vision_tower.patch_conv.weight.device)
        patches, h, w = self.vision_tower(pixels, height, width)
        return self.multi_modal_projector(patches, h, w)
