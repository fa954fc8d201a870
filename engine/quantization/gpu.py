"""The CUDA side of the linear methods: Triton W4A16/W8A16 kernels, and FP8 by the card's abilities.

Int weights run the split-K GEMV (decode batches) or the dequant-GEMM (prefill) of
kernels/triton_quant_linear.py straight from the packed layout the loader made, so nothing is repacked.
FP8 weights run W8A8 on cards with FP8 matrix units (compute capability 8.9+, e.g. the 4090) when the
checkpoint asks for FP8 activations, and otherwise weight-only: the Triton kernels decode the bytes in
registers, which Ampere (3090) can do. Imported only when a layer meets a CUDA tensor.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from kernels.quant_torch import fp8_w8a8_linear
from kernels.triton_quant_linear import quant_linear_triton


@functools.cache
def has_fp8_matmul(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def int_linear_cuda(method, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    names = method.names
    g_idx = getattr(layer, names["g_idx"]) if method.quant.act_order else None
    qweight = getattr(layer, names["qweight"])
    return quant_linear_triton(x, qweight, getattr(layer, names["scales"]), getattr(layer, names["zeros"]), g_idx,
                               method.quant.bits, layer.group_size, qweight.shape[1], bias=bias)


def fp8_linear_cuda(method, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    scale = getattr(layer, method.scale_name)
    fits_fp8_matmul = x.shape[-1] % 16 == 0 and layer.weight.shape[0] % 16 == 0  # _scaled_mm's shape rule
    # Block-wise scales vary along K, so they cannot be factored out of a whole-row FP8 matmul: weight-only.
    if (method.quant.activation_fp8 and method.quant.weight_block is None and fits_fp8_matmul
            and has_fp8_matmul(x.device.index or 0)):
        return fp8_w8a8_linear(x, layer.weight, scale, bias)
    return quant_linear_triton(x, layer.weight, scale, None, None, 8, getattr(layer, "group_size", 1),
                               layer.weight.shape[0], weight_fp8=True, bias=bias)
