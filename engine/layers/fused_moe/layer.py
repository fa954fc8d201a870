"""FusedMoE: every expert's weights of one MoE layer stacked into a few tensors, and the routed computation.

`w13_weight` [E, 2I, H] holds each expert's gate rows then up rows, `w2_weight` [E, H, I] its down projection
(optional `w13_bias` [E, 2I], `w2_bias` [E, H]); the layout of kernels/moe_torch.py and kernels/triton_moe.py.
Tensor parallel splits each expert's intermediate dim: gate/up rows (column-parallel) and down columns
(row-parallel), so every rank computes a partial sum of the output and the MoE block all-reduces it once; a
down bias is added on rank 0 only. `weight_loader(param, tensor, shard_id, expert_id)` takes one checkpoint
tensor per expert and projection (shard "w1" gate, "w3" up, "w2" down; expert_id None: a tensor stacked over
all experts); each parameter's `shard_ids` lists the (expert, shard) pairs the loader must see, so a checkpoint
missing one is an error naming it. The forward runs the Triton grouped GEMMs on CUDA and the torch reference loop elsewhere.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed import get_tp_rank, get_tp_size
from kernels.moe_torch import ACTIVATIONS, fused_moe_torch

SHARDS = ("w1", "w3", "w2")  # gate, up, down: the names vLLM and Mixtral's checkpoints use


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 bias: bool = False, prefix: str = "") -> None:
        super().__init__()
        tp = get_tp_size()
        if intermediate_size % tp:
            raise ValueError(f"{prefix}: the experts' intermediate size ({intermediate_size}, "
                             f"moe_intermediate_size) is not divisible by tensor_parallel_size ({tp}); "
                             "use another --tensor-parallel-size")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{prefix}: MoE activation {activation!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        self.prefix, self.activation = prefix, activation
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size // tp  # per rank
        i = self.intermediate_size
        self.w13_weight = self._param(torch.empty(num_experts, 2 * i, hidden_size), ("w1", "w3"))
        self.w2_weight = self._param(torch.empty(num_experts, hidden_size, i), ("w2",))
        self.w13_bias = self._param(torch.empty(num_experts, 2 * i), ("w1", "w3")) if bias else None
        self.w2_bias = self._param(torch.empty(num_experts, hidden_size), ("w2",)) if bias else None

    def _param(self, data: torch.Tensor, shards: tuple[str, ...]) -> nn.Parameter:
        p = nn.Parameter(data, requires_grad=False)
        p.weight_loader = self.weight_loader
        # What the loader (engine/models/weights.py) must see exactly once: every expert's gate and up, or down.
        p.shard_ids = {(e, s) for e in range(self.num_experts) for s in shards}
        return p

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int | None = None) -> None:
        if shard_id not in SHARDS:
            raise ValueError(f"{self.prefix}: expert shard {shard_id!r} is not one of {', '.join(SHARDS)}")
        if expert_id is None:  # stacked over experts, e.g. gpt-oss's [E, ...] tensors
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"{self.prefix}: a stacked expert tensor of shape {tuple(loaded.shape)} has "
                                 f"{loaded.shape[0]} experts, the config says {self.num_experts}")
            for e in range(self.num_experts):
                self.weight_loader(param, loaded[e], shard_id, e)
            return
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{self.prefix}: expert {expert_id} is out of range (num_experts {self.num_experts})")
        name = "w13" if param is self.w13_weight or param is self.w13_bias else "w2"
        if (name == "w13") != (shard_id != "w2"):
            raise ValueError(f"{self.prefix}: shard {shard_id!r} does not belong in {name}")
        self._copy(param.data[expert_id], loaded, shard_id, param is self.w13_bias or param is self.w2_bias)

    def _copy(self, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str, is_bias: bool) -> None:
        i, rank = self.intermediate_size, get_tp_rank()
        if shard_id == "w2" and is_bias:  # summed over ranks by the all-reduce: added once, on rank 0
            src = loaded if rank == 0 else torch.zeros_like(loaded)
        elif shard_id == "w2":
            src = _narrow(loaded, 1, rank * i, i, self.prefix)
        else:
            dst = dst.narrow(0, 0 if shard_id == "w1" else i, i)
            src = _narrow(loaded, 0, rank * i, i, self.prefix)
        if src.shape != dst.shape:
            raise ValueError(f"{self.prefix}: expert tensor {shard_id} of shape {tuple(loaded.shape)} does not fit "
                             f"the parameter slice {tuple(dst.shape)} (per rank)")
        dst.copy_(src)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the routed experts' outputs, [T, H] (the block all-reduces it)."""
        if x.is_cuda:
            from kernels.triton_moe import fused_moe_triton
            return fused_moe_triton(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation,
                                    self.w13_bias, self.w2_bias)
        return fused_moe_torch(x, self.w13_weight, self.w2_weight, topk_weights.to(x.dtype), topk_ids,
                               self.activation, self.w13_bias, self.w2_bias)


def _narrow(t: torch.Tensor, dim: int, start: int, size: int, prefix: str) -> torch.Tensor:
    if t.dim() <= dim or t.shape[dim] < start + size:
        raise ValueError(f"{prefix}: expert tensor of shape {tuple(t.shape)} has no [{start}, {start + size}) "
                         f"along dim {dim}")
    return t.narrow(dim, start, size)
