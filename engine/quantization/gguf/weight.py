"""GgufWeight: a quantized GGUF tensor on its way into the model, still in its blocks.

The loader (engine/worker/gguf_loader.py) hands each quantized tensor over as bytes [..., rows, row_bytes] of one
ggml type, mmapped from the file; float tensors (F32/F16/BF16) travel as plain tensors. Rows are independent,
so the slices the loaders take — a tensor-parallel rank's output rows, one expert of a stacked [E, rows, ...]
tensor, Llama's q/k rows put back in HF's order, one shard of a fused QKV — are slices of the bytes. An input
split (row-parallel layers) must fall on block boundaries: a split that would cut a block is refused, naming the
layer, the type and the block size. A parameter that keeps no GGUF bytes (norms, or a layer that has no GGUF
path) gets `dequantize()`d values instead.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.gguf_torch import block_format, dequantize_gguf


@dataclass(frozen=True, slots=True)
class GgufWeight:
    data: torch.Tensor  # uint8 [..., rows, row_bytes]
    type_id: int  # ggml type
    columns: int  # weights per row (the layer's input features)

    @property
    def type_name(self) -> str:
        return block_format(self.type_id).name

    @property
    def block_size(self) -> int:
        return block_format(self.type_id).block_size

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-1], self.columns)

    def dim(self) -> int:
        return self.data.dim()

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def narrow(self, dim: int, start: int, size: int) -> "GgufWeight":
        """Rows (or experts, or any dim but the blocks' own) [start, start + size)."""
        dim %= self.data.dim()
        if dim == self.data.dim() - 1:
            return self.columns_slice(start, size, "a GGUF tensor")
        return replace(self, data=self.data.narrow(dim, start, size))

    def __getitem__(self, index: int) -> "GgufWeight":
        """One entry of the outermost dim (an expert of a stacked expert tensor)."""
        return replace(self, data=self.data[index])

    def index_rows(self, order: torch.Tensor) -> "GgufWeight":
        """Rows in `order` (Llama's q/k un-permutation)."""
        return replace(self, data=self.data.index_select(-2, order))

    def columns_slice(self, start: int, size: int, where: str) -> "GgufWeight":
        """Input columns [start, start + size): whole blocks only."""
        fmt = block_format(self.type_id)
        if start % fmt.block_size or size % fmt.block_size:
            raise ValueError(f"{where}: a tensor-parallel split at input columns [{start}, {start + size}) cuts "
                             f"{fmt.name} blocks of {fmt.block_size} weights; GGUF weights split only between "
                             "blocks: use another --tensor-parallel-size")
        per_block = fmt.type_size
        return GgufWeight(self.data.narrow(-1, start // fmt.block_size * per_block, size // fmt.block_size * per_block),
                          self.type_id, size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_gguf(self.data, self.type_id, dtype)


def dequantized(tensor) -> torch.Tensor:
    """A checkpoint tensor as float values: a GgufWeight dequantized (float32), anything else as it is."""
    return tensor.dequantize(torch.float32) if isinstance(tensor, GgufWeight) else tensor
