"""RMSNorm (and Gemma's (1 + w) variant), with the residual add fused in the way decoder layers use it, the
Gated DeltaNet's gated output norm, and Gemma 4's plain RMSNorm in HF's order (its text model and vision tower)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_host_ops


class RMSNorm(nn.Module):
    weight_offset = 0.0  # applied as weight + offset (Gemma's: 1)

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:  # HF's casts are no-ops: its math in torch's one op
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual). A float32 decode batch on
        the CPU: one native call (kernels/cpu_host_ops.py) instead of torch's seven ops."""
        fused = cpu_host_ops.rms_norm(x, self.weight, self.eps, residual, self.weight_offset)
        if fused is not None:
            return fused[0] if residual is None else fused
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as w - 1 (zeros init) and applied as (1 + w), in float32, before
    the cast back — HF's order, which differs from Llama's in half precision."""
    weight_offset = 1.0

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__(size, eps)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:  # HF's casts are no-ops: its math in torch's one op
            return F.rms_norm(x, self.weight.shape, 1.0 + self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)


class GatedRMSNorm(RMSNorm):
    """The Gated DeltaNet output norm (HF's Qwen3NextRMSNormGated): RMSNorm with a plain weight (ones init),
    then times silu(gate) in float32, cast back — HF's order."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        out = self._norm(x)
        return (out * torch.nn.functional.silu(gate.float())).to(dtype)


class Gemma4RMSNorm(nn.Module):
    """x / rms(x) * w in float32, cast back after the weight (HF's order); without a weight for V."""

    def __init__(self, size: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.to(x.dtype)
