"""The MoE block a family puts where a dense MLP would be: router, routed experts, optional shared experts.

`Router` holds the replicated router matrix (`weight` [E, H], gpt-oss's `bias`, DeepSeek/GLM's
`e_score_correction_bias`); `SharedExperts` is a gate/up/down MLP every token goes through (GLM-4.5,
Qwen2-MoE/Qwen3-Next with a sigmoid `shared_expert_gate`). Under tensor parallel the routed experts and the
shared experts each give this rank's partial sum and the block all-reduces their total once. A block bound to
an ExpertLoad (expert_load.py) also counts its routing on the device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import all_reduce
from engine.layers.fused_moe.expert_load import ExpertLoad, decoder_layer_index
from engine.layers.fused_moe.layer import FusedMoE
from engine.layers.fused_moe.router import RouterSpec, select_experts
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from engine.quantization.config import QuantConfig


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, bias: bool = False, correction_bias: bool = False,
                 fp32: bool = False) -> None:
        super().__init__()
        dtype = torch.float32 if fp32 else None  # GLM routes in float32 whatever the model dtype
        self.fp32 = fp32
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False) if bias else None
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if correction_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return F.linear(x, self.weight, self.bias)


class SharedExperts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, quant: QuantConfig | None, prefix: str,
                 gated: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False, quant, prefix,
                                                       ("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, quant, prefix, ("down_proj",),
                                           reduce_results=False)
        # Qwen2-MoE / Qwen3-Next: a per-token sigmoid gate scales the shared expert's output.
        self.gate = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.gate is None else torch.sigmoid(F.linear(x, self.gate)) * out


class SparseMoeBlock(nn.Module):
    """Router + FusedMoE (+ SharedExperts): x [T, H] -> [T, H], one all-reduce under tensor parallel."""

    def __init__(self, spec: RouterSpec, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
                 expert_bias: bool = False, router_bias: bool = False, correction_bias: bool = False,
                 router_fp32: bool = False, shared_intermediate_size: int = 0, shared_gate: bool = False,
                 quant: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.spec = spec
        self.gate = Router(spec.num_experts, hidden_size, router_bias, correction_bias, router_fp32)
        experts_quant = quant if quant is not None and not quant.is_ignored(f"{prefix}.experts") else None
        self.experts = FusedMoE(spec.num_experts, hidden_size, intermediate_size, activation, expert_bias,
                                f"{prefix}.experts", experts_quant)
        self.shared_experts = (SharedExperts(hidden_size, shared_intermediate_size, quant,
                                             f"{prefix}.shared_experts", shared_gate)
                               if shared_intermediate_size else None)
        self.layer_index = decoder_layer_index(prefix)
        self.expert_load: ExpertLoad | None = None  # bound by the runner on rank 0 (expert_load.py)
        self.expert_load_row = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.spec, self.gate.e_score_correction_bias)
        if self.expert_load is not None:
            self.expert_load.record(self.expert_load_row, topk_ids)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return all_reduce(out)
