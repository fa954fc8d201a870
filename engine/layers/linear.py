"""Linear layers that know how they are split across tensor-parallel ranks.

Each parameter carries its own `weight_loader(param, loaded, shard_id)`, so sharding lives next to the
layer that knows the split: column-parallel layers keep a slice of the output rows (QKV and gate/up are
several column-parallel matrices stacked), row-parallel layers keep a slice of the input columns and
all-reduce their output. With one rank the loaders simply copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce, divide, get_tp_rank, get_tp_size


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output rows split across ranks: each rank computes its slice of the output, no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, divide(out_features, get_tp_size(), "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, get_tp_rank() * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one (gate and up projections); shard_id is the index."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        tp = get_tp_size()
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, get_tp_rank() * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix; KV heads are replicated when there are fewer than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        if num_kv_heads >= tp:
            divide(num_kv_heads, tp, "key/value heads")
        elif tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of the KV heads ({num_kv_heads})")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        rank = get_tp_rank()
        if shard_id == "q":
            offset, size, start = 0, q_size, rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (rank // self.kv_replicas) * kv_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input columns split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(divide(in_features, get_tp_size(), "input features"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: added once, on rank 0
            param.data.copy_(loaded if get_tp_rank() == 0 else torch.zeros_like(loaded))
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, get_tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight, self.bias))
