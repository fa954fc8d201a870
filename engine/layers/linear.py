"""Linear layers that know how they are split across tensor-parallel ranks.

Each parameter carries its own `weight_loader(param, loaded, shard_id)`, so sharding lives next to the
layer that knows the split: column-parallel layers keep a slice of the output features (QKV and gate/up
are several column-parallel matrices stacked; a checkpoint that stores them fused, as Phi-3 does, arrives with
shard id None and is split into its shards here), row-parallel layers keep a slice of the input features and
all-reduce their output. What the parameters are — a float matrix, or packed codes with scales, zero points
and g_idx — is the layer's linear method (engine/quantization/methods.py); each parameter names its output
and input dims, so the same loaders slice float and packed weights. With one rank the loaders simply copy.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import all_reduce, divide, get_tp_rank, get_tp_size
from engine.quantization.config import QuantConfig
from engine.quantization.methods import UnquantizedLinearMethod, linear_method
from kernels import cpu_linear


def checkpoint_modules(packed_modules_mapping: dict, stacked: str) -> tuple[str, ...]:
    """The checkpoint's module names behind our stacked module (a family's packed_modules_mapping, e.g. q/k/v_proj
    behind qkv_proj): its parts, or itself when stored fused. The quantization method reads them by name."""
    parts = packed_modules_mapping.get(stacked)
    return tuple(part for part, _ in parts) if parts else (stacked,)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantConfig | None = None,
                 prefix: str = "", modules: tuple[str, ...] = ("",), full_in: int | None = None) -> None:
        super().__init__()
        self.prefix = f"{prefix}.{'/'.join(modules)}".strip(".")  # e.g. model.layers.0.self_attn.q_proj/k_proj/v_proj
        self.method = linear_method(quant, [f"{prefix}.{m}".strip(".") for m in modules])
        self.method.create_weights(self, in_features, out_features, full_in or in_features)
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.output_dim, self.bias.input_dim = 0, None
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    dequantized: torch.Tensor | None = None  # a quantized layer's float copy, kept under --cpu-dequant-cache

    def is_quantized(self) -> bool:
        return not isinstance(self.method, UnquantizedLinearMethod)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dequantized is not None:
            return cpu_linear.linear(x, self.dequantized, self.bias)
        return self.method.apply(self, x, self.bias)

    shard_ids: tuple = (None,)  # the checkpoint matrices stacked in this layer, as the loader names them

    def load_fused(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A checkpoint tensor holding every stacked matrix at once (Phi-3's qkv_proj and gate_up_proj): split
        it along the output dim into the shards' full sizes and load each as if it had come alone."""
        if param.output_dim is None:  # g_idx: one per input row, the same for every shard
            for shard_id in self.shard_ids:
                self.weight_loader(param, loaded, shard_id)
            return
        converted = self.method.convert(param, loaded) if param is not self.bias else loaded
        sizes = self.checkpoint_output_sizes()
        if converted.numel() == 1:  # a per-tensor scale covers every shard
            pieces = [converted] * len(sizes)
        elif converted.dim() <= param.output_dim or converted.shape[param.output_dim] != sum(sizes):
            raise ValueError(f"{self.prefix}: fused checkpoint tensor of shape {tuple(loaded.shape)} does not "
                             f"stack {len(sizes)} matrices of {sizes} output features along dim {param.output_dim}")
        else:
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            pieces = [converted.narrow(param.output_dim, o, n) for o, n in zip(offsets, sizes)]
        for shard_id, piece in zip(self.shard_ids, pieces):
            self.weight_loader(param, piece, shard_id, converted=True)

    def checkpoint_output_sizes(self) -> list[int]:
        """Output features of each stacked matrix as the checkpoint stores it (all ranks together)."""
        raise NotImplementedError

    def load_slice(self, param: nn.Parameter, loaded: torch.Tensor, offset: int, size: int, start: int,
                   split_input: bool = False, shard=None, converted: bool = False) -> None:
        """Copy rows [start, start+size) of `loaded`'s output dim into [offset, offset+size) of the parameter,
        and this rank's slice of its input dim when `split_input`."""
        if param is not self.bias and hasattr(self.method, "load_slice"):  # GGUF: the method lays out its bytes
            return self.method.load_slice(self, loaded, offset, size, start, split_input)
        if not converted and param is not self.bias:
            loaded = self.method.convert(param, loaded)
        dst, dim = param.data, param.output_dim
        if dim is None:  # g_idx: one per input row, shared by every stacked matrix
            seen = param.__dict__.setdefault("loaded_shards", set())
            # Compared on the parameter's device: torch.equal refuses a CUDA tensor against a host one.
            if seen and not torch.equal(dst, _input_slice(param, loaded, split_input).to(dst.device)):
                raise ValueError(f"{self.prefix}: the stacked matrices have different g_idx; such checkpoints "
                                 "are not supported")
            seen.add(shard)
        elif loaded.numel() == 1 and dst.shape[dim] > 1:  # a per-tensor scale fills this matrix's channels
            dst.narrow(dim, offset, size).fill_(loaded.reshape(()).item())
            return
        elif loaded.dim() != dst.dim() or loaded.shape[dim] < start + size:
            raise ValueError(f"{self.prefix}: checkpoint tensor of shape {tuple(loaded.shape)} has no rows "
                             f"[{start}, {start + size}) along dim {dim} for parameter {tuple(dst.shape)}")
        else:
            dst, loaded = dst.narrow(dim, offset, size), loaded.narrow(dim, start, size)
        loaded = _input_slice(param, loaded, split_input)
        if dst.shape != loaded.shape:
            raise ValueError(f"{self.prefix}: checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"parameter slice {tuple(dst.shape)}")
        dst.copy_(loaded)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This rank's weight as a float [out, in] matrix (tests compare it to a direct dequantization)."""
        return self.method.dequantized_weight(self, dtype)


def _input_slice(param: nn.Parameter, loaded: torch.Tensor, split_input: bool) -> torch.Tensor:
    if not split_input or param.input_dim is None:
        return loaded
    dim = param.input_dim
    size = param.shape[dim]
    return loaded.narrow(dim, get_tp_rank() * size, size)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: each rank computes its slice of the output, no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: QuantConfig | None = None,
                 prefix: str = "", modules: tuple[str, ...] = ("",)) -> None:
        super().__init__(in_features, divide(out_features, get_tp_size(), "output features"), bias, quant, prefix,
                         modules)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[param.output_dim] if param.output_dim is not None else 0
        self.load_slice(param, loaded, 0, size, get_tp_rank() * size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one (gate and up projections); shard_id is the index."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 quant: QuantConfig | None = None, prefix: str = "", modules: tuple[str, ...] = ("",)) -> None:
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(in_features, sum(output_sizes), bias, quant, prefix, modules)

    def checkpoint_output_sizes(self) -> list[int]:
        return list(self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None,
                      converted: bool = False) -> None:
        if shard_id is None:
            return self.load_fused(param, loaded)
        tp = get_tp_size()
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        self.load_slice(param, loaded, offset, size, get_tp_rank() * size, shard=shard_id, converted=converted)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix; KV heads are replicated when there are fewer than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant: QuantConfig | None = None, prefix: str = "", modules: tuple[str, ...] = ("",)) -> None:
        self.split_heads(head_dim, num_heads, num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, quant, prefix, modules)

    def split_heads(self, head_dim: int, num_heads: int, num_kv_heads: int) -> None:
        """This rank's share of the heads: query heads divided, KV heads divided or replicated."""
        tp = get_tp_size()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp, "attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        if num_kv_heads >= tp:
            divide(num_kv_heads, tp, "key/value heads")
        elif tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of the KV heads ({num_kv_heads})")

    shard_ids = ("q", "k", "v")

    def checkpoint_output_sizes(self) -> list[int]:
        return [self.total_num_heads * self.head_dim] + [self.total_num_kv_heads * self.head_dim] * 2

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None,
                      converted: bool = False) -> None:
        if shard_id is None:
            return self.load_fused(param, loaded)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        rank = get_tp_rank()
        if shard_id == "q":
            offset, size, start = 0, q_size, rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (rank // self.kv_replicas) * kv_size
        self.load_slice(param, loaded, offset, size, start, shard=shard_id, converted=converted)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce (unless the caller sums
    several partial outputs first and reduces once, `reduce_results=False`: an MoE block's shared experts)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: QuantConfig | None = None,
                 prefix: str = "", modules: tuple[str, ...] = ("",), reduce_results: bool = True) -> None:
        super().__init__(divide(in_features, get_tp_size(), "input features"), out_features, bias, quant, prefix,
                         modules, full_in=in_features)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:  # added once, on rank 0
            param.data.copy_(loaded if get_tp_rank() == 0 else torch.zeros_like(loaded))
            return
        size = param.shape[param.output_dim] if param.output_dim is not None else 0
        self.load_slice(param, loaded, 0, size, 0, split_input=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # the float copy under --cpu-dequant-cache, else the method
        return all_reduce(out) if self.reduce_results else out


def keep_dequantized(model: nn.Module, budget_bytes: float, dtype: torch.dtype) -> int:
    """Float copies of quantized linears' weights (`dequantized`; a GGUF LM head's too), in the model's order
    while `budget_bytes` lasts; the bytes they hold. On the CPU a quantized layer otherwise dequantizes its
    blocks on every call (GGUF's run 3-7x slower than float there), while the blocks stay the only copy."""
    held = 0
    for module in model.modules():
        if not hasattr(module, "dequantized") or not module.is_quantized():
            continue
        if module.dequantized is None:
            weight = module.dequantized_weight(dtype)
            nbytes = weight.numel() * weight.element_size()
            if held + nbytes > budget_bytes:
                continue
            module.dequantized = weight
        held += module.dequantized.numel() * module.dequantized.element_size()
    return held
