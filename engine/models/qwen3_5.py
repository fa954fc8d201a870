"""Qwen3.5 / Qwen3.6, dense and MoE (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) and their vision-language
checkpoints served as text (…ForConditionalGeneration): the hybrid decoder of engine/models/qwen3_next.py.

What differs from Qwen3-Next: the DeltaNet input projections are stored split (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`); the dense model has a dense MLP on every layer, the MoE model a routed block with a
gated shared expert on every layer; RoPE is mRoPE, which on text positions (all three sections equal the 1-D
position) is the plain partial-rotary table (engine/layers/rotary.py). A VL checkpoint keeps the text model
under `model.language_model.` and its vision tower under `model.visual.` (engine/models/qwen3_5_vision.py): the
VL classes load both, turn an image's patches into embeddings (`encode_image`) and read mRoPE's three position
streams on every attention layer. The MTP head (`mtp.*`) is not part of the target: speculative method "mtp"
loads it (engine/models/qwen3_next_mtp.py).
"""
from __future__ import annotations

import torch

from engine.config.model import ModelConfig
from engine.models.qwen3_5_vision import Qwen3_5VisionTower
from engine.models.qwen3_next import HYBRID_GGUF_NAMES, MTP_PREFIX, SHARED_EXPERT_INFIXES, Qwen3NextForCausalLM
from engine.models.weights import WeightsMapper

TEXT_MAPPER = WeightsMapper(skipped_prefixes=(MTP_PREFIX,), renamed_infixes=SHARED_EXPERT_INFIXES)
VL_MAPPER = WeightsMapper(
    renamed_prefixes=(("model.language_model.", "model."), ("language_model.model.", "model."),
                      ("language_model.lm_head.", "lm_head."), ("model.visual.", "visual.")),
    skipped_prefixes=(MTP_PREFIX,), renamed_infixes=SHARED_EXPERT_INFIXES)
# A VL folder served as text (no image processor beside it, ModelConfig.from_folder): the tower is skipped, never loaded.
VL_TEXT_ONLY_MAPPER = WeightsMapper(
    renamed_prefixes=VL_MAPPER.renamed_prefixes[:3], skipped_prefixes=(MTP_PREFIX, "model.visual.", "visual."),
    renamed_infixes=SHARED_EXPERT_INFIXES)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    split_projections = True
    weights_mapper = TEXT_MAPPER
    gguf_names = {"qwen35": HYBRID_GGUF_NAMES}


class Qwen3_5VisionLanguage:
    """The VL checkpoints' additions to their text model: the tower, mRoPE on every attention layer, encode_image.
    Qwen3-VL shares it (engine/models/qwen3_vl.py) with its own mappers."""

    weights_mapper = VL_MAPPER
    text_only_mapper = VL_TEXT_ONLY_MAPPER

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        super().__init__(cfg, backend)
        if cfg.vision is None:  # served as text: on text positions mRoPE is the plain table
            self.weights_mapper = self.text_only_mapper
            return
        self.visual = Qwen3_5VisionTower(cfg.vision.tower)
        tables = {id(layer.self_attn.rotary_emb): layer.self_attn.rotary_emb
                  for layer in self.model.layers if not getattr(layer, "is_linear", False)}
        for table in tables.values():
            table.use_mrope(cfg.vision.mrope_section)

    def encode_image(self, data: dict) -> torch.Tensor:
        device = self.visual.inv_freq.device
        grid = tuple(int(x) for x in data["image_grid_thw"][0])
        return self.visual(data["pixel_values"].to(device), grid)


class Qwen3_5ForConditionalGeneration(Qwen3_5VisionLanguage, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's MLP is the routed block with a gated shared expert (ModelConfig.moe)."""

    gguf_names = {"qwen35moe": HYBRID_GGUF_NAMES}


class Qwen3_5MoeForConditionalGeneration(Qwen3_5VisionLanguage, Qwen3_5MoeForCausalLM):
    pass
