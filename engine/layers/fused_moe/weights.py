"""Checkpoint names of expert tensors -> (FusedMoE parameter, expert id, shard id), for every family's loader.

Per-expert checkpoints (Qwen3-MoE, GLM, DeepSeek: `mlp.experts.3.gate_proj.weight`; Mixtral:
`block_sparse_moe.experts.3.w1.weight`) are recognised by one pattern. gpt-oss stores each projection
stacked over experts and transposed, with gate and up columns interleaved (`experts.gate_up_proj` [E, H, 2I],
gate in the even columns); `split_interleaved_gate_up` turns that into the gate and up halves. Packed leaves
(AWQ/GPTQ `qweight`/`qzeros`/`scales`/`g_idx`, compressed-tensors `weight_packed`/`weight_scale`/
`weight_zero_point`/`weight_g_idx`, FP8 `weight`/`weight_scale_inv`/`weight_scale`, MXFP4 `blocks`/`scales`) map to the FusedMoE parameter of the same leaf name.
"""
from __future__ import annotations

import re

import torch

# "<prefix>.experts[.<id>].<proj>.<weight|bias>"; without an id the tensor is stacked over all experts.
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?:(?P<expert>\d+)\.)?(?P<proj>[a-z0-9_]+)\."
                           r"(?P<leaf>weight|bias|qweight|qzeros|scales|g_idx|weight_packed|weight_scale|"
                           r"weight_zero_point|weight_g_idx|weight_scale_inv|blocks)$")
PROJ_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}


def expert_shard(name: str) -> tuple[str, int | None, str] | None:
    """("…experts.w13_weight", 3, "w1") for "…experts.3.gate_proj.weight" (expert None for "…experts.gate_proj
    .weight", stacked over experts); None for a tensor of no expert."""
    m = EXPERT_TENSOR.match(name)
    if m is None or m["proj"] not in PROJ_SHARDS:
        return None
    shard = PROJ_SHARDS[m["proj"]]
    expert = None if m["expert"] is None else int(m["expert"])
    return f"{m['prefix']}.{'w2' if shard == 'w2' else 'w13'}_{m['leaf']}", expert, shard


def split_interleaved_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss [E, H, 2I] (or bias [E, 2I]) with gate/up alternating along the last dim -> gate, up in our
    [E, I, H] ([E, I]) layout."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    if gate_up.dim() == 3:
        gate, up = gate.transpose(1, 2), up.transpose(1, 2)
    return gate.contiguous(), up.contiguous()
