"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary.

A scaled embedding (Gemma's, times sqrt(hidden_size)) multiplies by its scale as HF does: a float32 number rounded to
the weights' dtype. That rounding is done once, into a buffer on the device, never per forward: a host number
turned into a device tensor inside forward is a pageable copy, which CUDA graph capture refuses. A GGUF file's
embedding (often Q4_K or Q6_K) stays in its blocks: a lookup decodes only the rows it gathers, the LM head
multiplies through the GGUF GEMV/GEMM like any linear layer, and a tied head shares the same bytes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from engine.quantization.gguf.weight import GgufWeight
from kernels import cpu_linear
from kernels.gguf_cpu import gguf_linear
from kernels.gguf_torch import dequantize_gguf, gguf_linear_torch


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None, gguf: bool = False) -> None:
        """`gguf`: the weight may stay in a GGUF file's blocks ([rows, row bytes], its type on the parameter)."""
        super().__init__()
        tp = get_tp_size()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.shard_size = (vocab_size + tp - 1) // tp  # the last rank's slice is zero-padded
        self.vocab_start = get_tp_rank() * self.shard_size
        self.float_dtype = torch.get_default_dtype()  # the model's dtype, set while it is built
        self.weight = nn.Parameter(torch.zeros(self.shard_size, 0 if gguf else hidden_size,
                                               dtype=torch.uint8 if gguf else None), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.gguf, self.weight.gguf_type = gguf, None  # gguf_type: set when blocks are loaded
        scale_tensor = None if scale is None else torch.tensor(scale, dtype=torch.float32).to(self.float_dtype)
        self.register_buffer("embed_scale", scale_tensor, persistent=False)  # HF's rounding, made once

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        if param.gguf:  # a GGUF file's rows as stored (zero bytes pad a last shard: they decode to zeros)
            blocks = isinstance(rows, GgufWeight)
            param.gguf_type = rows.type_id if blocks else None
            data = rows.data if blocks else rows.to(self.float_dtype)
            param.data = torch.zeros(self.shard_size, data.shape[-1], dtype=data.dtype, device=param.device)
            rows = data
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self._lookup(input_ids)
        return out if self.embed_scale is None else out * self.embed_scale

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.gguf_type is None:
            return F.embedding(ids, self.weight)
        rows = self.weight.index_select(0, ids.reshape(-1))  # the looked-up rows' blocks, decoded alone
        return dequantize_gguf(rows, self.weight.gguf_type, self.float_dtype).view(*ids.shape, self.hidden_size)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return self._embed(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = self._embed(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    dequantized: torch.Tensor | None = None  # a GGUF head's float copy, kept under --cpu-dequant-cache

    def is_quantized(self) -> bool:
        return self.weight.gguf_type is not None

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_gguf(self.weight, self.weight.gguf_type, dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.dequantized is not None:
            logits = cpu_linear.linear(hidden, self.dequantized)
        elif self.weight.gguf_type is None:
            logits = cpu_linear.linear(hidden, self.weight)
        elif hidden.is_cuda:
            from kernels.triton_gguf import gguf_linear_triton
            logits = gguf_linear_triton(hidden, self.weight, self.weight.gguf_type)
        else:  # a CPU decode batch of the block types it decodes: the native block GEMM (kernels/gguf_cpu.py)
            logits = gguf_linear(hidden, self.weight, self.weight.gguf_type)
            if logits is None:
                logits = gguf_linear_torch(hidden, self.weight, self.weight.gguf_type)
        return all_gather_last_dim(logits)[..., :self.vocab_size]
