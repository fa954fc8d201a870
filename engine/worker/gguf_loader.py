"""Stream a GGUF file's (or split set's) tensors into a model under our names, mmapped, never read and copied whole.

Each part of the file is mapped copy-on-write (numpy memmap, mode "c"), so a tensor is a view of the mapping:
the operating system pages in what the model's parameters copy from it, and the file is never read into memory
whole. Names come from the family's `gguf_names` for the file's architecture (engine/models/weights.GgufNames);
the converter's edits are undone on the way: Llama's q/k rows are put back in HF's rotate-half order (a row
permutation, so quantized rows move as bytes), Gemma's norms get their stored 1 + w back to w, and a family's own
`edit` undoes the rest (the hybrids' DeltaNet tensors); the MTP layers a converter appends after the target's
(`blk.N`, N >= layers) are skipped. Float tensors (F32/F16/BF16) come as tensors; quantized ones as GgufWeight,
kept in their blocks by the layers that can (engine/quantization/gguf/), dequantized by the loader for the others.
The header was checked when the config was read (engine/config/gguf_file.py): types, splits and sizes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

from engine.config.gguf_file import GgufTensorInfo, read_gguf_header
from engine.models.weights import GgufNames
from engine.quantization.gguf.weight import GgufWeight

FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def gguf_names(model: nn.Module, architecture: str) -> GgufNames:
    names = getattr(type(model), "gguf_names", {}).get(architecture)
    if names is None:
        raise ValueError(f"{type(model).__name__} declares no GGUF tensor names for GGUF architecture "
                         f"{architecture!r}")
    return names


def iterate_gguf_weights(path: str | Path, model: nn.Module) -> Iterator[tuple[str, object]]:
    """(our checkpoint name, tensor or GgufWeight) for every tensor of the GGUF at `path` that `model` loads."""
    header = read_gguf_header(path)
    names = gguf_names(model, header.architecture)
    cfg = model.config
    maps = {file: np.memmap(file, dtype=np.uint8, mode="c") for file in header.files}
    for info in header.tensors.values():
        if _nextn_block(info.name, cfg.num_layers):  # the MTP head's blocks follow the target's: not loaded here
            continue
        name = names.map(info.name)
        if name is None:
            continue
        tensor = gguf_tensor(info, maps[info.file])
        if names.permuted_qk and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            tensor = unpermute_rows(tensor, heads)
        if names.norm_offset and name.endswith("norm.weight"):
            tensor = tensor.to(torch.float32) - names.norm_offset
        if names.edit is None:
            yield name, tensor
        else:
            yield from names.edit(name, tensor, cfg)


def _nextn_block(name: str, num_layers: int) -> bool:
    """`blk.N.*` with N past the target's layers: llama.cpp's converter appends the MTP (nextn) layers there."""
    parts = name.split(".")
    return parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= num_layers


def gguf_tensor(info: GgufTensorInfo, mapping: np.memmap) -> torch.Tensor | GgufWeight:
    """One tensor as a view of the file's mapping: floats in their dtype, quantized types as bytes per row."""
    raw = torch.from_numpy(mapping[info.offset:info.offset + info.nbytes])
    if info.type.name in FLOAT_DTYPES:
        return raw.view(FLOAT_DTYPES[info.type.name]).view(info.shape)
    rows = info.shape[:-1] or (1,)
    return GgufWeight(raw.view(*rows, -1), info.type.id, info.shape[-1])


def unpermute_rows(tensor: torch.Tensor | GgufWeight, heads: int) -> torch.Tensor | GgufWeight:
    """llama.cpp stores each head's q/k rows as interleaved pairs (row 2i + j of a head is HF's row j * d/2 + i):
    back to HF's order."""
    rows = tensor.shape[0]
    order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(tensor, GgufWeight):
        return tensor.index_rows(order)
    return tensor.index_select(0, order)
