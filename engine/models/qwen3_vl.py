"""Qwen3-VL, dense (Qwen3VLForConditionalGeneration): a Qwen3 text model (the Llama block with q/k norms) under
Qwen3.5's vision tower, with interleaved mRoPE on every layer and DeepStack.

DeepStack: the tower also merges the outputs of a few of its blocks (`deepstack_visual_indexes`) into extra sets of
embeddings (engine/models/qwen3_5_vision.py returns them beside the main ones, along the width); the main set
replaces the image's placeholder embeddings as in every VL family, and set i is added to the hidden states at the
image's positions after decoder layer i, as HF's `_deepstack_process` does. The step's image rows carry all sets,
so a chunk that cuts an image adds each layer's features to exactly the rows it holds. Served as text (no image
processor beside the folder) the tower is skipped and the model is Qwen3 on plain positions.

Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration) is the same over Qwen3-MoE's layers (its router always
renormalizes the top k), with each layer's experts stored as two tensors stacked over experts, gate and up fused
(`experts.gate_up_proj`, `experts.down_proj`): in the hub's files transposed ([E, H, 2I], [E, I, H]), as
transformers 5 saves them not ([E, 2I, H], [E, H, I]). `split_fused_experts` tells the two apart by the config's
sizes and hands the loader per-projection tensors stacked over experts.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from engine.layers.attention import AttentionMetadata
from engine.layers.decoder import DecoderModel
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3_5 import Qwen3_5VisionLanguage
from engine.models.qwen3_moe import moe_block
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
        self.begin_step(positions)
        try:
            for index, layer in enumerate(self.layers):
                x, residual = layer(positions, x, residual, meta)
                if index < len(deepstack):  # x is still to be added to residual: adding here adds to the stream
                    x = x.index_add(0, rows, deepstack[index].to(x.dtype))
        finally:
            self.end_step()
        x, _ = self.norm(x, residual)
        return x


class Qwen3VLForConditionalGeneration(Qwen3_5VisionLanguage, LlamaForCausalLM):
    model_class = DeepStackDecoderModel
    weights_mapper = VL_MAPPER
    text_only_mapper = TEXT_ONLY_MAPPER


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    mlp_factory = moe_block

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_fused_experts(weights, self.config.hidden_size, self.config.moe.intermediate_size))


def split_fused_experts(weights: Iterable[tuple[str, torch.Tensor]], hidden: int,
                        intermediate: int) -> Iterator[tuple[str, torch.Tensor]]:
    """`experts.gate_up_proj` -> `experts.gate_proj.weight` and `experts.up_proj.weight`, `experts.down_proj` ->
    `experts.down_proj.weight`, each [E, out, in] (stacked over experts, as the loader takes them); other tensors
    pass through."""
    for name, tensor in weights:
        leaf = name.rsplit(".", 1)[-1]
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            yield name, tensor
            continue
        out = 2 * intermediate if leaf == "gate_up_proj" else hidden
        inp = hidden if leaf == "gate_up_proj" else intermediate
        shape = tuple(tensor.shape[1:])
        if out == inp or shape not in ((out, inp), (inp, out)):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} is neither [E, {out}, {inp}] nor [E, {inp}, {out}]"
                             f" (hidden {hidden}, moe_intermediate_size {intermediate}), or cannot tell which")
        if shape == (inp, out):  # the hub's files: transposed
            tensor = tensor.transpose(1, 2)
        prefix = name[:-len(leaf)]
        if leaf == "down_proj":
            yield prefix + "down_proj.weight", tensor.contiguous()
        else:
            yield prefix + "gate_proj.weight", tensor[:, :intermediate].contiguous()
            yield prefix + "up_proj.weight", tensor[:, intermediate:].contiguous()
