"""GgufLinearMethod: a linear layer whose weight stays in the GGUF file's blocks, each stacked part in its own type.

A GGUF file picks a type per tensor (a Q4_K_M file keeps attn_q/attn_k in Q4_K and attn_v in Q6_K on some
layers), and our layers stack q/k/v and gate/up into one matrix. So the method learns each part's type as it
loads: every part's rows of this rank arrive as bytes (a GgufWeight) or floats (F32/F16/BF16, kept in the model's
dtype) and wait until the layer's rows are complete; then they are laid out back to back in the one `weight`
parameter, a flat byte tensor, and neighbouring parts of one type become one run, multiplied in one call (a
uniform layer is one run; a Q4_K q/k over a Q6_K v is two, their outputs concatenated). Until then `weight` is a
[rows, 0] placeholder, so the layers' loaders size their slices as for any format. A row-parallel layer takes
this rank's input columns, whole blocks only (GgufWeight.columns_slice refuses a split that cuts one). CPU runs
dequantize a run per call (kernels/gguf_torch.py); CUDA runs the Triton GEMV / GEMM of kernels/triton_gguf.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed.parallel_state import get_tp_rank
from engine.quantization.gguf.weight import GgufWeight
from kernels import cpu_linear
from kernels.gguf_torch import block_format, dequantize_gguf, gguf_linear_torch, row_bytes
from kernels.gguf_cpu import gguf_linear

FLOAT = -1  # a run's type when it holds floats in the model dtype


@dataclass(frozen=True, slots=True)
class GgufRun:
    """Consecutive output rows of one type inside the layer's flat `weight` bytes."""
    type_id: int  # ggml type, or FLOAT
    rows: int
    byte_start: int
    nbytes: int


class GgufLinearMethod:
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, full_in: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, 0, dtype=torch.uint8), requires_grad=False)
        layer.weight.output_dim, layer.weight.input_dim, layer.weight.input_unit = 0, 1, 1
        layer.weight.role = "weight"
        layer.weight.gguf = True  # the loader hands it GgufWeights as they are (engine/models/weights.py)
        self.in_features, self.out_features = in_features, out_features
        self.float_dtype = torch.get_default_dtype()  # the model's dtype, set while it is built
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}  # output row offset -> (type, rows)
        self.runs: list[GgufRun] = []

    def convert(self, param: nn.Parameter, loaded):
        return loaded

    def load_slice(self, layer: nn.Module, loaded, offset: int, size: int, start: int, split_input: bool) -> None:
        """Rows [start, start + size) of a checkpoint tensor, this rank's input columns when `split_input`, as this
        layer's output rows [offset, offset + size)."""
        if self.runs:
            raise ValueError(f"{layer.prefix}: a GGUF weight was loaded after the layer's rows were complete")
        first_col = get_tp_rank() * self.in_features if split_input else 0
        if isinstance(loaded, GgufWeight):
            piece = loaded.narrow(0, start, size)
            if split_input:
                piece = piece.columns_slice(first_col, self.in_features, layer.prefix)
            type_id, data = piece.type_id, piece.data
            expected = (size, row_bytes(type_id, self.in_features))
        else:
            data = loaded.narrow(0, start, size).narrow(1, first_col, self.in_features).to(self.float_dtype)
            type_id, expected = FLOAT, (size, self.in_features)
        if tuple(data.shape) != expected:
            raise ValueError(f"{layer.prefix}: GGUF tensor rows of shape {tuple(data.shape)} do not fit "
                             f"{expected} (rows, {'bytes' if type_id != FLOAT else 'columns'} per row)")
        self.pending[offset] = (type_id, data.to(layer.weight.device).contiguous())
        if sum(t.shape[0] for _, t in self.pending.values()) == self.out_features:
            self._lay_out(layer)

    def _lay_out(self, layer: nn.Module) -> None:
        """The complete rows, back to back in `weight`; neighbouring parts of one type joined into runs."""
        parts, row, runs, start = sorted(self.pending.items()), 0, [], 0
        for offset, (type_id, data) in parts:
            if offset != row:
                raise ValueError(f"{layer.prefix}: GGUF rows [{row}, {offset}) were never loaded")
            nbytes = data.numel() * data.element_size()
            if runs and runs[-1].type_id == type_id:
                last = runs[-1]
                runs[-1] = GgufRun(type_id, last.rows + data.shape[0], last.byte_start, last.nbytes + nbytes)
            else:
                runs.append(GgufRun(type_id, data.shape[0], start, nbytes))
            row, start = row + data.shape[0], start + nbytes
        flat = torch.cat([data.reshape(-1).view(torch.uint8) for _, (_, data) in parts])
        layer.weight.data = flat
        self.pending, self.runs = {}, runs

    def run_weight(self, layer: nn.Module, run: GgufRun) -> torch.Tensor:
        """A run's rows: floats [rows, in] or bytes [rows, row_bytes]."""
        data = layer.weight.data.narrow(0, run.byte_start, run.nbytes)
        if run.type_id == FLOAT:
            return data.view(self.float_dtype).view(run.rows, self.in_features)
        return data.view(run.rows, -1)

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([self.run_weight(layer, run).to(dtype) if run.type_id == FLOAT else
                          dequantize_gguf(self.run_weight(layer, run), run.type_id, dtype) for run in self.runs])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.runs:
            raise RuntimeError(f"{layer.prefix}: the GGUF weight was never loaded")
        outs = [self._run(layer, run, x) for run in self.runs]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if bias is None else out + bias

    def _run(self, layer: nn.Module, run: GgufRun, x: torch.Tensor) -> torch.Tensor:
        w = self.run_weight(layer, run)
        if run.type_id == FLOAT:
            return cpu_linear.linear(x, w.to(x.dtype))
        if x.is_cuda:
            from kernels.triton_gguf import gguf_linear_triton
            return gguf_linear_triton(x, w, run.type_id)
        native = gguf_linear(x, w, run.type_id)  # a CPU decode batch of blocks kernels/gguf_gemm.c decodes
        return gguf_linear_torch(x, w, run.type_id) if native is None else native

    def describe(self) -> str:
        return " + ".join(f"{run.rows} rows {'float' if run.type_id == FLOAT else block_format(run.type_id).name}"
                          for run in self.runs)
