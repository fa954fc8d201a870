"""The MoE router: score each token's router logits, pick its top-k experts, and weight them as the family says.

Families differ only in a few switches (RouterSpec): softmax or sigmoid scoring; renormalising the k chosen
weights to sum to one (Mixtral always, Qwen3-MoE by `norm_topk_prob`); softmax over the k chosen logits
(gpt-oss, which also has a router bias); DeepSeek/GLM's per-expert correction bias that moves the choice but
not the weight, group-limited choice (`n_group`, `topk_group`) and a routed scaling factor. Weights come out
in float32, ids as int64; the same function runs on every device and inside CUDA graphs (no host syncs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCORING = ("softmax", "sigmoid")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    softmax_after_topk: bool = False  # gpt-oss: top-k of the raw logits, then softmax over those k
    num_groups: int = 1  # group-limited routing: only experts in the best `topk_groups` groups are eligible
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORING:
            raise ValueError(f"router scoring {self.scoring!r} is not supported (choose {', '.join(SCORING)})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of experts "
                             f"({self.num_experts})")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"router groups: {self.num_experts} experts in n_group={self.num_groups} groups with "
                             f"topk_group={self.topk_groups} do not split evenly")


def select_experts(router_logits: torch.Tensor, spec: RouterSpec,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, k], topk_ids int64 [T, k]) from router logits [T, E]."""
    logits = router_logits.float()
    if spec.softmax_after_topk:
        top_logits, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1), ids
    scores = torch.softmax(logits, dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if spec.num_groups > 1:
        choice = _mask_groups(choice, spec)
    if correction_bias is None and spec.num_groups == 1:
        weights, ids = torch.topk(choice, spec.top_k, dim=-1)
    else:  # the bias (and group mask) only choose; the weights are the unbiased scores
        ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


def _mask_groups(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """-inf outside each token's best `topk_groups` groups, a group scored by its two best experts."""
    grouped = choice.view(-1, spec.num_groups, spec.num_experts // spec.num_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, spec.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice), float("-inf"))
