"""Mixture-of-experts layers: the router, the stacked experts (FusedMoE), the block families use, its load counters."""
from engine.layers.fused_moe.block import Router, SharedExperts, SparseMoeBlock
from engine.layers.fused_moe.expert_load import ExpertLoad
from engine.layers.fused_moe.layer import FusedMoE
from engine.layers.fused_moe.router import RouterSpec, select_experts

__all__ = ["ExpertLoad", "FusedMoE", "Router", "RouterSpec", "SharedExperts", "SparseMoeBlock", "select_experts"]
