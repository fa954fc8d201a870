"""Qwen3-VL, dense (Qwen3VLForConditionalGeneration): a Qwen3 text model (the Llama block with q/k norms) under
Qwen3.5's vision tower, with interleaved mRoPE on every layer and DeepStack.

DeepStack: the tower also merges the outputs of a few of its blocks (`deepstack_visual_indexes`) into extra sets of
embeddings (engine/models/qwen3_5_vision.py returns them beside the main ones, along the width); the main set
replaces the image's placeholder embeddings as in every VL family, and set i is added to the hidden states at the
image's positions after decoder layer i, as HF's `_deepstack_process` does. The step's image rows carry all sets,
so a chunk that cuts an image adds each layer's features to exactly the rows it holds. Served as text (no image
processor beside the folder) the tower is skipped and the model is Qwen3 on plain positions. Qwen3-VL-MoE
(Qwen3VLMoeForConditionalGeneration) is not built: its text model is Qwen3-MoE with fused expert tensors.
"""
from __future__ import annotations

import torch

from engine.config.model import ModelConfig
from engine.layers.attention import AttentionMetadata
from engine.layers.decoder import DecoderModel
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3_5_vision import Qwen3_5VisionTower
from engine.models.registry import VL_TEXT_PREFIXES
from engine.models.weights import WeightsMapper

VL_MAPPER = WeightsMapper(renamed_prefixes=VL_TEXT_PREFIXES + (("model.visual.", "visual."),))
TEXT_ONLY_MAPPER = WeightsMapper(renamed_prefixes=VL_TEXT_PREFIXES, skipped_prefixes=("model.visual.", "visual."))


class DeepStackDecoderModel(DecoderModel):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`mm_embeds`: (token rows, [rows, (1 + k) * hidden]): the main embeddings, then DeepStack's k sets."""
        if mm_embeds is None:
            return super().forward(input_ids, positions, meta)
        rows, embeds = mm_embeds
        main, *deepstack = embeds.split(self.embed_tokens.hidden_size, dim=-1)
        x, residual = self.embed_input(input_ids, (rows, main)), None
        for index, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, meta)
            if index < len(deepstack):  # x is still to be added to residual: adding here adds to the stream
                x = x.index_add(0, rows, deepstack[index].to(x.dtype))
        x, _ = self.norm(x, residual)
        return x


class Qwen3VLForConditionalGeneration(LlamaForCausalLM):
    model_class = DeepStackDecoderModel
    weights_mapper = VL_MAPPER

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        super().__init__(cfg, backend)
        if cfg.vision is None:  # served as text: on text positions mRoPE is the plain table
            self.weights_mapper = TEXT_ONLY_MAPPER
            return
        self.visual = Qwen3_5VisionTower(cfg.vision.tower)
        tables = {id(layer.self_attn.rotary_emb): layer.self_attn.rotary_emb for layer in self.model.layers}
        for table in tables.values():
            table.use_mrope(cfg.vision.mrope_section)

    def encode_image(self, data: dict) -> torch.Tensor:
        device = self.visual.inv_freq.device
        grid = tuple(int(x) for x in data["image_grid_thw"][0])
        return self.visual(data["pixel_values"].to(device), grid)
