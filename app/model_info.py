"""What a local Hugging Face model folder holds, read without loading weights.

Architecture, context length, dtype (`torch_dtype`, or `dtype` as transformers 5 writes it) and quantization
(method, bits, group size) come from config.json; the parameter count and the tensor names (which say, e.g.,
whether an MTP head is there) come from the safetensors headers (8-byte length + JSON of dtype/shape per
tensor) of each shard listed in model.safetensors.index.json, or of every *.safetensors file. A GGUF file is
described from its header (engine/config/gguf_file.py). Only headers are read, never tensors.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


@dataclass
class ModelInfo:
    path: Path
    architecture: str
    num_parameters: int | None
    context_length: int | None
    dtype: str
    config: dict = field(default_factory=dict)
    quantization: str | None = None  # e.g. "awq 4-bit g128 asym", from quantization_config
    active_parameters: int | None = None  # mixture-of-experts models: what one token goes through
    tensor_names: frozenset[str] = frozenset()  # every tensor in the checkpoint, from the headers

    def describe(self) -> str:
        params = format_count(self.num_parameters) if self.num_parameters else "unknown"
        if self.active_parameters and self.num_parameters:
            params = f"{params} total, {format_count(self.active_parameters)} active"
        context = f"{self.context_length:,}" if self.context_length else "unknown"
        weights = f" · {self.quantization}" if self.quantization else ""
        return f"{self.architecture} · {params} parameters · context {context} tokens · {self.dtype}{weights}"


def format_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 * 1024 * 1024:
            raise ValueError(f"{path.name}: safetensors header of {length} bytes is implausible")
        return json.loads(f.read(length))


QUANT_METADATA = ("qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape",
                  "weight_g_idx", "input_scale")


def checkpoint_headers(folder: Path) -> dict[str, dict] | None:
    """{tensor name: {dtype, shape, ...}} over the folder's safetensors shards, or None without any."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    return {name: entry for file in files for name, entry in safetensors_header(file).items()
            if name != "__metadata__"}


def count_parameters(folder: Path, codes_per_word: int = 1, headers: dict[str, dict] | None = None) -> int | None:
    """Sum of tensor element counts over the folder's safetensors shards, or None without any. In a
    quantized folder each packed int32 word holds `codes_per_word` weights, and scales, zero points and
    g_idx are not parameters."""
    headers = checkpoint_headers(folder) if headers is None else headers
    if headers is None:
        return None
    total = 0
    for name, entry in headers.items():
        if codes_per_word > 1 and name.rsplit(".", 1)[-1] in QUANT_METADATA:
            continue
        packed = entry["dtype"] == "I32" and name.endswith(("qweight", "weight_packed"))
        total += math.prod(entry["shape"]) * (codes_per_word if packed else 1)
    return total


def text_config(config: dict) -> dict:
    """Multimodal configs nest the language model's settings under text_config."""
    return config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config


def read_gguf_info(path: str | Path) -> ModelInfo:
    """A GGUF file (or split set) from its header: the architecture the engine serves it as (or llama.cpp's name
    for one it does not), parameters from the tensor shapes, context from the metadata, the tensor types' shares
    as the quantization, and the HF config the engine reads from it (the planner's input); ValueError for a
    damaged file."""
    from engine.config.gguf_config import gguf_hf_config
    from engine.config.gguf_file import read_gguf_header
    from engine.quantization.gguf.types import describe_types, file_type_name
    header = read_gguf_header(path, check_types=False)
    params = sum(t.numel for t in header.tensors.values())
    context = header.arch_value("context_length")
    file_type = file_type_name(header.metadata.get("general.file_type"))
    quant = (f"{file_type} " if file_type else "") + f"({describe_types(header.bytes_by_type())})"
    try:
        config, _ = gguf_hf_config(header)
        architecture = config["architectures"][0]
    except (ValueError, KeyError):  # an architecture the engine does not serve (or incomplete metadata): listed
        config, architecture = {}, f"{header.architecture} (GGUF)"
    unread = sorted({t.type.name for t in header.tensors.values() if not t.type.supported})
    if unread:
        quant += f" · not supported: {', '.join(unread)}"
    return ModelInfo(Path(path), architecture, params, int(context) if context else None, "gguf", config, quant,
                     active_parameters(config) if config else None, frozenset(header.tensors))


def read_model_info(folder: str | Path) -> ModelInfo:
    """A model folder's description, or a GGUF file's (read_gguf_info)."""
    if str(folder).lower().endswith(".gguf"):
        return read_gguf_info(folder)
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{folder} has no config.json; choose a Hugging Face model folder")
    config = json.loads(config_path.read_text())
    text = text_config(config)
    architecture = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    context = next((text[k] for k in CONTEXT_KEYS if isinstance(text.get(k), int)), None)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
                or "unknown")
    quant, codes_per_word = quantization(config)
    headers = checkpoint_headers(folder)
    return ModelInfo(folder, architecture, count_parameters(folder, codes_per_word, headers), context, dtype, config,
                     quant, active_parameters(config), frozenset(headers or ()))


def active_parameters(config: dict) -> int | None:
    """Active parameters of an MoE model, from the engine's torch-free config arithmetic; None when dense or
    when the engine cannot read the config."""
    from engine.config.model import ModelConfig
    try:
        cfg = ModelConfig.from_hf_config(config)
    except (ValueError, KeyError, TypeError):
        return None
    return cfg.num_active_params if cfg.moe is not None else None


def quantization(config: dict) -> tuple[str | None, int]:
    """Method, bits and group size of a quantized folder (or what is unsupported about it), and how many
    weights one packed int32 word holds."""
    from engine.quantization.config import parse_quantization_config
    if not (config.get("quantization_config") or config.get("compression_config")):
        return None, 1
    try:
        quant = parse_quantization_config(config)
    except ValueError as e:
        return f"quantized, not supported: {e}", 1
    return quant.describe(), quant.pack_factor
