"""Torch reference for a mixture-of-experts layer: route each token to its top-k experts and sum the results.

Layout shared with the Triton kernel (kernels/triton_moe.py): `w13` [E, 2I, H] holds each expert's gate rows
then up rows, `w2` [E, H, I] its down projection, optional biases `w13_bias` [E, 2I] and `w2_bias` [E, H];
`topk_ids` [T, k] and `topk_weights` [T, k] come from the router. The loop visits only the experts that
received tokens, so a decode step touches k experts' weights, not all of them. `w13`/`w2` may be anything
indexable by expert id that returns a float matrix: quantized experts are `PackedExperts` (W4A16/W8A16 int
codes, GPTQ act order included, FP8, MXFP4, or GGUF blocks), dequantized one routed expert at a time by
kernels/quant_torch.py or kernels/gguf_torch.py. This is the CPU path and the oracle the Triton kernel is tested
against; it imports only those two.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_linear
from kernels.gguf_cpu import gguf_linear
from kernels.gguf_torch import block_format, dequantize_gguf
from kernels.quant_torch import MXFP4_BLOCK, dequantize_fp8, dequantize_int, dequantize_mxfp4

ACTIVATIONS = ("silu", "swigluoai")
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU constants


@dataclass(frozen=True)
class PackedExperts:
    """One projection's stacked quantized experts, kept packed; `experts[e]` is expert e's float [N, K] matrix.

    format "int": `weight` int32 words [E, K / pack, N] (codes packed along K), `scales` [E, G, N] float and
    `zeros` [E, G, N] unsigned zero points, groups of `group_size` input rows (kernels/quant_torch.py's layout,
    per expert), with `g_idx` [E, K] int32 the group of every input row under GPTQ act order (desc_act), else
    row k is in group k // group_size. format "fp8": `weight` float8_e4m3fn [E, N, K] and float32 `scales`
    [E, N, ceil(K / group_size)], one per output row and block of `group_size` input columns (block-wise FP8;
    per-channel is one block spanning K, [E, N, 1]). format "mxfp4": `weight` uint8 [E, N, K / 2] (two E2M1
    codes a byte), `scales` uint8 E8M0 [E, N, K / 32]. format "gguf": `weight` uint8 [E, N, K / QK * type_size],
    every expert's rows in llama.cpp block format `ggml_type` (kernels/gguf_torch.py), no scales beside them.
    `dtype` is what a dequantized expert comes out as."""
    format: str
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    bits: int = 4
    group_size: int = MXFP4_BLOCK
    dtype: torch.dtype = torch.float32
    g_idx: torch.Tensor | None = None
    ggml_type: int = -1  # format "gguf": the block format of every expert's rows

    def __post_init__(self) -> None:
        if self.format not in ("int", "fp8", "mxfp4", "gguf"):
            raise ValueError(f"packed experts format {self.format!r} is not one of int, fp8, mxfp4, gguf")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(experts, N, K) of the float weights this encodes."""
        e, a, b = self.weight.shape
        if self.format == "gguf":
            fmt = block_format(self.ggml_type)
            return e, a, b // fmt.type_size * fmt.block_size
        return {"int": (e, b, a * (32 // self.bits)), "fp8": (e, a, b), "mxfp4": (e, a, b * 2)}[self.format]

    def linear(self, e: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ expert e's matrix.T (+ bias): GGUF blocks of a CPU decode batch through the native block GEMM
        (kernels/gguf_cpu.py), anything else dequantized first."""
        if self.format == "gguf":
            out = gguf_linear(x, self.weight[e], self.ggml_type)
            if out is not None:
                return out if bias is None else out + bias
        return cpu_linear.linear(x, self[e], bias)

    def __getitem__(self, e: int) -> torch.Tensor:
        if self.format == "gguf":
            return dequantize_gguf(self.weight[e], self.ggml_type, self.dtype)
        if self.format == "mxfp4":
            return dequantize_mxfp4(self.weight[e], self.scales[e], self.dtype)
        if self.format == "fp8":
            return dequantize_fp8(self.weight[e], self.scales[e], self.dtype, self.group_size)
        return dequantize_int(self.weight[e], self.scales[e], self.zeros[e], self.bits, self.group_size,
                              None if self.g_idx is None else self.g_idx[e], self.dtype)


def moe_activation(gate_up: torch.Tensor, activation: str, alpha: float = SWIGLU_ALPHA,
                   limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """[.., 2I] gate|up -> [.., I]: SwiGLU (silu(gate) * up), or gpt-oss's clamped form (swigluoai)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swigluoai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"unknown MoE activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")


def _expert_linear(w, e: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return w.linear(e, x, bias) if isinstance(w, PackedExperts) else cpu_linear.linear(x, w[e], bias)


def fused_moe_torch(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    activation: str = "silu", w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None, alpha: float = SWIGLU_ALPHA,
                    limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token t: [T, H] -> [T, H]."""
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=1).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        entries = order[start:start + count]  # positions in the flattened [T * k] routing table
        start += count
        tokens = entries // topk_ids.shape[1]
        gate_up = _expert_linear(w13, expert, x[tokens], None if w13_bias is None else w13_bias[expert])
        hidden = _expert_linear(w2, expert, moe_activation(gate_up, activation, alpha, limit),
                                None if w2_bias is None else w2_bias[expert])
        weights = topk_weights.reshape(-1)[entries].unsqueeze(1)
        out.index_add_(0, tokens, (hidden * weights).to(out.dtype))
    return out
