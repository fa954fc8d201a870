"""Linear methods: which parameters a linear layer holds for its checkpoint format and how it multiplies.

A linear layer asks `linear_method(quant, modules)` for its method (vLLM's LinearMethod idea): the method
registers the layer's parameters under the checkpoint's own tensor names, converts each checkpoint tensor
once into the shared packed layout of kernels/quant_torch.py (AWQ's interleaved words are re-packed, GPTQ's
stored zero points get their offset, compressed-tensors' [N, K/8] words are transposed), and computes the
layer's output. Every parameter says which dim is the output dim and which the input dim (and how many input
rows one index covers), so the layer's tensor-parallel loaders slice packed words, scales, zeros and g_idx at
group boundaries without knowing the format. Weights stay packed: the CPU path dequantizes per call. In memory
AWQ/GPTQ scales stay float16 (compressed-tensors' float32, as its scales may be bfloat16) and 4-bit zero points
are bytes (8-bit ones int16: GPTQ v1's stored zero + 1 can be 256).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.quantization.config import QuantConfig
from kernels import cpu_linear
from kernels.quant_torch import awq_unpack, dequantize_fp8, dequantize_int, pack_int32, unpack_int32

# Checkpoint tensor names of each int family, by role in the packed layout.
INT_NAMES = {
    "gptq": {"qweight": "qweight", "zeros": "qzeros", "scales": "scales", "g_idx": "g_idx"},
    "awq": {"qweight": "qweight", "zeros": "qzeros", "scales": "scales", "g_idx": None},
    "compressed-tensors": {"qweight": "weight_packed", "zeros": "weight_zero_point", "scales": "weight_scale",
                           "g_idx": "weight_g_idx"},
}


def new_param(data: torch.Tensor, output_dim: int | None, input_dim: int | None, input_unit: int = 1,
              role: str = "weight") -> nn.Parameter:
    """A frozen parameter tagged with how it splits: `input_unit` input rows per index along `input_dim`."""
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim, p.input_dim, p.input_unit, p.role = output_dim, input_dim, input_unit, role
    return p


def skipped_tensor(quant: QuantConfig | None, name: str) -> bool:
    """Checkpoint tensors the engine reads nothing from (shape records, static input scales, trivial g_idx)."""
    if quant is None:
        return False
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("weight_shape", "input_scale"):
        return True
    return leaf in ("g_idx", "weight_g_idx") and not quant.act_order


def int_group_dtypes(quant: QuantConfig) -> tuple[torch.dtype, torch.dtype]:
    """(scale dtype, zero-point dtype) a packed int weight keeps in memory (engine/planning/weights.py counts the
    same)."""
    scale = torch.float32 if quant.method == "compressed-tensors" else torch.float16
    return scale, torch.uint8 if quant.bits <= 4 else torch.int16


class UnquantizedLinearMethod:
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, full_in: int) -> None:
        layer.weight = new_param(torch.empty(out_features, in_features), 0, 1)

    def convert(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        return loaded

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return layer.weight.to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_linear.linear(x, layer.weight, bias)


class IntLinearMethod:
    """AWQ, GPTQ and compressed-tensors pack-quantized weights: 4- or 8-bit codes with scales and zero points."""

    def __init__(self, quant: QuantConfig) -> None:
        self.quant = quant
        self.names = INT_NAMES[quant.method]
        self.scale_dtype, self.zero_dtype = int_group_dtypes(quant)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, full_in: int) -> None:
        q = self.quant
        pack, group = q.pack_factor, q.group_size
        if in_features % pack:
            raise ValueError(f"{layer.prefix}: {in_features} input features per rank are not a multiple of "
                             f"{pack} ({q.bits}-bit codes packed {pack} per word); use another "
                             "--tensor-parallel-size")
        if q.act_order or group == -1:  # every rank keeps every group; g_idx (or one group) picks rows
            num_groups, group_dim = (-(-full_in // group) if group != -1 else 1), None
        elif in_features % group:
            raise ValueError(f"{layer.prefix}: {in_features} input features per rank do not hold whole groups "
                             f"of {group} (group_size); use another --tensor-parallel-size")
        else:
            num_groups, group_dim = in_features // group, 0
        layer.group_size = group if group != -1 else in_features
        setattr(layer, self.names["qweight"], new_param(
            torch.empty(in_features // pack, out_features, dtype=torch.int32), 1, 0, pack, "qweight"))
        setattr(layer, self.names["scales"], new_param(
            torch.empty(num_groups, out_features, dtype=self.scale_dtype), 1, group_dim, group, "scales"))
        zeros = torch.empty(num_groups, out_features, dtype=self.zero_dtype)
        if q.method == "compressed-tensors" and q.symmetric:  # nothing stored: codes are offset by half the range
            layer.register_buffer(self.names["zeros"], zeros.fill_(1 << (q.bits - 1)))
        else:
            setattr(layer, self.names["zeros"], new_param(zeros, 1, group_dim, group, "zeros"))
        if q.act_order:
            setattr(layer, self.names["g_idx"], new_param(torch.empty(in_features, dtype=torch.int32), None, 0, 1,
                                                          "g_idx"))

    def convert(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """One checkpoint tensor in the packed layout (codes packed along K, zeros unsigned, scales [G, N])."""
        q, role = self.quant, param.role
        if role == "g_idx":
            return loaded.to(torch.int32)
        if role == "scales":
            return (loaded.t() if q.method == "compressed-tensors" else loaded).to(self.scale_dtype)
        _check_int32(loaded, role)
        if q.method == "awq":
            codes = awq_unpack(loaded)
            return pack_int32(codes, 4, dim=0) if role == "qweight" else codes.to(self.zero_dtype)
        if q.method == "gptq":
            if role == "qweight":
                return loaded
            return (unpack_int32(loaded, q.bits, 1) + q.zero_offset).to(self.zero_dtype)
        if role == "qweight":  # compressed-tensors: [N, K / pack] words packed along K
            return loaded.t().contiguous()
        return unpack_int32(loaded, q.bits, 0).t().to(self.zero_dtype)  # zero points packed along N

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        g_idx = getattr(layer, self.names["g_idx"]) if self.quant.act_order else None
        return dequantize_int(getattr(layer, self.names["qweight"]), getattr(layer, self.names["scales"]),
                              getattr(layer, self.names["zeros"]), self.quant.bits, layer.group_size, g_idx, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            from engine.quantization.gpu import int_linear_cuda
            return int_linear_cuda(self, layer, x, bias)
        return cpu_linear.linear(x, self.dequantized_weight(layer, x.dtype), bias)


def fp8_scale_name(quant: QuantConfig) -> str:
    """The checkpoint's name for an FP8 weight's scales: block-wise `quant_method: fp8` checkpoints (Qwen3-*-FP8,
    DeepSeek) call theirs `weight_scale_inv` (a multiplier despite the name), everyone else `weight_scale`."""
    return "weight_scale_inv" if quant.weight_block and quant.method == "fp8" else "weight_scale"


def expand_block_scales(loaded: torch.Tensor, block_rows: int) -> torch.Tensor:
    """[ceil(N / rows), KB] block scales -> [ceil(N / rows) * rows, KB]: each block's scale on each of its rows,
    so the loaders slice scales by output row like the weight (any tensor-parallel split, merged shards)."""
    if loaded.dim() != 2:
        raise ValueError(f"FP8 block scales have shape {tuple(loaded.shape)}, expected [row blocks, column blocks]")
    return loaded.to(torch.float32).repeat_interleave(block_rows, dim=0)


class Fp8LinearMethod:
    """FP8 e4m3 weights with a per-tensor, per-channel or block-wise scale (quant_method fp8, compressed-tensors
    float). Block scales are kept per output row and block of `group_size` input columns (expand_block_scales):
    4 bytes per row and block, 1/32 of the FP8 bytes at 128-wide blocks."""

    def __init__(self, quant: QuantConfig) -> None:
        self.quant = quant
        self.scale_name = fp8_scale_name(quant)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, full_in: int) -> None:
        layer.weight = new_param(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), 0, 1)
        block = self.quant.weight_block
        if block is None:
            setattr(layer, self.scale_name, new_param(torch.empty(out_features, dtype=torch.float32), 0, None, 1,
                                                      "scales"))
            return
        cols = block[1]
        if in_features != full_in and in_features % cols:
            raise ValueError(f"{layer.prefix}: {in_features} input features per rank do not hold whole FP8 blocks "
                             f"of {cols} (weight_block_size {list(block)}); use another --tensor-parallel-size")
        layer.group_size = cols
        setattr(layer, self.scale_name, new_param(torch.empty(out_features, -(-in_features // cols),
                                                              dtype=torch.float32), 0, 1, cols, "scales"))

    def convert(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        if param.role == "scales":
            if self.quant.weight_block is not None:
                return expand_block_scales(loaded, self.quant.weight_block[0])
            return loaded.to(torch.float32).reshape(-1)  # [N, 1] per channel, [] or [1] per tensor
        if loaded.dtype != torch.float8_e4m3fn:
            raise ValueError(f"an FP8 checkpoint weight has dtype {loaded.dtype}, expected float8_e4m3fn")
        return loaded

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(layer.weight, getattr(layer, self.scale_name), dtype, getattr(layer, "group_size", -1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            from engine.quantization.gpu import fp8_linear_cuda
            return fp8_linear_cuda(self, layer, x, bias)
        return cpu_linear.linear(x, self.dequantized_weight(layer, x.dtype), bias)


def _check_int32(loaded: torch.Tensor, role: str) -> None:
    if loaded.dtype != torch.int32:
        raise ValueError(f"a packed {role} tensor has dtype {loaded.dtype}, expected int32 words")


def linear_method(quant: QuantConfig | None, modules: list[str]):
    """The method for a layer built from checkpoint `modules` (several when stacked, e.g. q/k/v_proj)."""
    if quant is None:
        return UnquantizedLinearMethod()
    if quant.method == "gguf":  # each tensor's own type, learnt as it loads
        from engine.quantization.gguf.method import GgufLinearMethod
        return GgufLinearMethod()
    ignored = [quant.is_ignored(m) for m in modules]
    if all(ignored):
        return UnquantizedLinearMethod()
    if any(ignored):
        raise ValueError(f"the checkpoint quantizes only some of {modules} (ignore list), but they are stacked "
                         "into one layer here; such checkpoints are not supported")
    if quant.weight_type == "mxfp4":
        raise ValueError(f"the checkpoint stores {modules} in MXFP4; the engine reads MXFP4 only for MoE experts "
                         "(gpt-oss), not for linear layers")
    return Fp8LinearMethod(quant) if quant.weight_type == "float" else IntLinearMethod(quant)
