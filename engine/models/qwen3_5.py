"""Qwen3.5 / Qwen3.6, dense and MoE (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) and their vision-language
checkpoints served as text (…ForConditionalGeneration): the hybrid decoder of engine/models/qwen3_next.py.

What differs from Qwen3-Next: the DeltaNet input projections are stored split (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`); the dense model has a dense MLP on every layer, the MoE model a routed block with a
gated shared expert on every layer; RoPE is mRoPE, which on text positions (all three sections equal the 1-D
position) is the plain partial-rotary table (engine/layers/rotary.py). A VL checkpoint keeps the text model
under `model.language_model.`; the vision tower (`model.visual.`) is skipped on purpose, and the MTP head
(`mtp.*`) is not part of the target: speculative method "mtp" loads it (engine/models/qwen3_next_mtp.py).
"""
from __future__ import annotations

from engine.models.qwen3_next import MTP_PREFIX, SHARED_EXPERT_INFIXES, Qwen3NextForCausalLM
from engine.models.weights import WeightsMapper

TEXT_MAPPER = WeightsMapper(skipped_prefixes=(MTP_PREFIX,), renamed_infixes=SHARED_EXPERT_INFIXES)
VL_MAPPER = WeightsMapper(
    renamed_prefixes=(("model.language_model.", "model."), ("language_model.model.", "model."),
                      ("language_model.lm_head.", "lm_head.")),
    skipped_prefixes=(MTP_PREFIX, "model.visual.", "visual."), renamed_infixes=SHARED_EXPERT_INFIXES)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    split_projections = True
    weights_mapper = TEXT_MAPPER


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    weights_mapper = VL_MAPPER


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's MLP is the routed block with a gated shared expert (ModelConfig.moe)."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    weights_mapper = VL_MAPPER
