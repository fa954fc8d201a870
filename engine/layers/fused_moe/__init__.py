"""Mixture-of-experts layers: the router, the stacked experts (FusedMoE) and the block families use."""
from engine.layers.fused_moe.block import Router, SharedExperts, SparseMoeBlock
from engine.layers.fused_moe.layer import FusedMoE
from engine.layers.fused_moe.router import RouterSpec, select_experts

__all__ = ["FusedMoE", "Router", "RouterSpec", "SharedExperts", "SparseMoeBlock", "select_experts"]
