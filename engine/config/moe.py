"""MoEConfig: what a Hugging Face config.json says about a model's mixture-of-experts layers, family by family.

Each family names the same few facts differently (Qwen3-MoE `num_experts`/`moe_intermediate_size`/
`norm_topk_prob`/`mlp_only_layers`; Mixtral `num_local_experts` with the experts' size in
`intermediate_size`; gpt-oss the same plus router and expert biases and a clamped SwiGLU; GLM-4.5
`n_routed_experts`, shared experts, `first_k_dense_replace`, sigmoid routing with groups and a correction
bias). This module reads them into one description, and counts total and active parameters (every expert is
in memory; a token goes through top_k of them). Torch-free: the planner and the GUI read the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any



@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    moe_layers: tuple[int, ...]  # the other layers have a dense MLP of the model's intermediate_size
    scoring: str = "softmax"
    renormalize: bool = False
    softmax_after_topk: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    shared_intermediate_size: int = 0
    shared_gate: bool = False  # Qwen3-Next / Qwen3.5: a sigmoid gate [1, H] scales the shared expert

    def router_spec_kwargs(self) -> dict[str, Any]:
        """The fields engine/layers/fused_moe/router.py's RouterSpec takes."""
        return dict(num_experts=self.num_experts, top_k=self.top_k, scoring=self.scoring,
                    renormalize=self.renormalize, softmax_after_topk=self.softmax_after_topk,
                    num_groups=self.num_groups, topk_groups=self.topk_groups,
                    routed_scaling_factor=self.routed_scaling_factor)

    def layer_params(self, hidden_size: int) -> tuple[int, int, int]:
        """(all experts' matrix params, the top_k experts' and shared experts' matrix params, router and bias
        params) of one MoE layer."""
        h, i = hidden_size, self.intermediate_size
        expert = 3 * h * i
        shared = 3 * h * self.shared_intermediate_size
        vectors = self.num_experts * h + (self.num_experts if self.router_bias or self.correction_bias else 0)
        if self.expert_bias:
            vectors += self.num_experts * (2 * i + h)
        if self.shared_gate:
            vectors += h
        return self.num_experts * expert + shared, self.top_k * expert + shared, vectors


def parse_moe_config(hf: dict[str, Any], architecture: str) -> MoEConfig | None:
    """The MoE description of a config.json dict, or None for a dense architecture."""
    layers = hf["num_hidden_layers"]
    if architecture in ("Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration"):
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        vl = architecture == "Qwen3VLMoeForConditionalGeneration"  # its router always renormalizes the top k
        return MoEConfig(_experts(hf, "num_experts"), hf["num_experts_per_tok"], hf["moe_intermediate_size"], moe,
                         renormalize=vl or bool(hf.get("norm_topk_prob", False)))
    if architecture == "Qwen3NextForCausalLM":  # Qwen3-MoE's routing plus a sigmoid-gated shared expert
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        if not hf.get("num_experts", 512):
            return None
        moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return MoEConfig(_experts(hf, "num_experts"), hf["num_experts_per_tok"], hf["moe_intermediate_size"], moe,
                         renormalize=bool(hf.get("norm_topk_prob", True)),
                         shared_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
                         shared_gate=bool(hf.get("shared_expert_intermediate_size", 0)))
    if architecture in ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"):  # every layer, renormalized
        return MoEConfig(_experts(hf, "num_experts"), hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                         tuple(range(layers)), renormalize=True,
                         shared_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
                         shared_gate=bool(hf.get("shared_expert_intermediate_size", 0)))
    if architecture == "MixtralForCausalLM":
        return MoEConfig(hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"],
                         tuple(range(layers)), renormalize=True)
    if architecture == "GptOssForCausalLM":
        return MoEConfig(hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"],
                         tuple(range(layers)), softmax_after_topk=True, router_bias=True, expert_bias=True,
                         activation="swigluoai")
    if architecture == "Glm4MoeForCausalLM":
        first_dense = hf.get("first_k_dense_replace", 1)
        i = hf["moe_intermediate_size"]
        return MoEConfig(_experts(hf, "n_routed_experts"), hf["num_experts_per_tok"], i,
                         tuple(range(first_dense, layers)),
                         scoring="sigmoid", renormalize=bool(hf.get("norm_topk_prob", True)),
                         num_groups=hf.get("n_group", 1), topk_groups=hf.get("topk_group", 1),
                         routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), correction_bias=True,
                         shared_intermediate_size=i * hf.get("n_shared_experts", 1))
    return None


def _experts(hf: dict[str, Any], family_key: str) -> int:
    """The family's own key as published; transformers 5 writes `num_local_experts` for every family."""
    value = hf.get(family_key, hf.get("num_local_experts"))
    if value is None:
        raise ValueError(f"config.json has neither {family_key} nor num_local_experts: how many experts?")
    return int(value)
