"""QuantConfig: what a model folder's `quantization_config` says about its packed weights, checked once.

Reads the checkpoint families the engine serves — AWQ (gemm), GPTQ (v1 and v2 zero convention, act
order), compressed-tensors (pack-quantized int4/int8, float-quantized FP8), `fp8`, MXFP4 (gpt-oss's experts)
and AutoRound (`auto-round`, whose int exports are GPTQ v1 or AWQ gemm packing) — into one flat
description (method, bits, group size, symmetry, act order, which modules stay in float). Anything else is
refused here with the values found, so a folder never half-loads. Torch-free: the GUI's planner and model
info read the same object the engine builds its layers from.
"""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SUPPORTED_METHODS = ("awq", "gptq", "compressed-tensors", "fp8", "mxfp4", "auto-round", "gguf")
# A GGUF type's nominal bits per weight (QuantConfig.bits of a GGUF model is its largest share's)
GGUF_BITS = {"Q4_0": 4, "Q4_K": 4, "IQ4_XS": 4, "IQ4_NL": 4, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8, "F16": 16, "BF16": 16,
             "F32": 32}


@dataclass(frozen=True)
class QuantConfig:
    method: str  # awq | gptq | compressed-tensors | fp8 | mxfp4
    # "int" (packed codes, scales, zero points) | "float" (fp8 e4m3 values, scales) | "mxfp4" (OCP MX: FP4 E2M1
    # values with one E8M0 power-of-two scale per 32; gpt-oss quantizes only its experts this way)
    weight_type: str
    bits: int
    group_size: int  # weights sharing one scale along the input dim; -1: one per output channel
    symmetric: bool = True
    act_order: bool = False  # rows of the input dim are assigned to groups by a stored g_idx
    zero_offset: int = 0  # added to stored zero points (GPTQ v1 stores zero - 1)
    ignore: tuple[str, ...] = ()  # module names or "re:" patterns that stay unquantized
    activation_fp8: bool = False  # the checkpoint asks for FP8 activations (W8A8) where the card has FP8
    origin: str = ""  # the tool that wrote it when `method` is its packing, e.g. "auto-round" (gptq packing)
    # FP8 block-wise scales (DeepSeek-style `weight_block_size` [rows, cols], e.g. Qwen3-*-FP8's [128, 128]):
    # one scale per block of output rows x input columns; group_size is then the block's input columns
    weight_block: tuple[int, int] | None = None
    # GGUF (method "gguf"): the file's weight bytes per ggml type, largest first; each tensor keeps its own type
    gguf_bytes: tuple[tuple[str, int], ...] = ()

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits if self.weight_type == "int" else 1

    def describe(self) -> str:
        """Short human form, e.g. "awq 4-bit g128 asym" or "fp8 e4m3 weights, fp8 activations"."""
        if self.method == "gguf":
            from engine.quantization.gguf.types import describe_types
            return f"gguf {describe_types(dict(self.gguf_bytes))}"
        if self.weight_type == "mxfp4":
            return "mxfp4 experts (e2m1, e8m0 scale per 32)"
        if self.weight_type == "float":
            block = f" {self.weight_block[0]}x{self.weight_block[1]} blocks" if self.weight_block else ""
            return f"{self.method} e4m3 weights{block}{', fp8 activations' if self.activation_fp8 else ''}"
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        extra = " act-order" if self.act_order else ""
        extra += "" if self.symmetric else " asym"
        method = f"{self.origin} ({self.method} packing)" if self.origin else self.method
        return f"{method} {self.bits}-bit {group}{extra}"

    def is_ignored(self, module: str) -> bool:
        """Whether a checkpoint module (e.g. "model.layers.0.mlp.down_proj") stays in float. A plain entry names
        whole dotted parts anywhere in the name, so the bare "linear_attn" of a hybrid checkpoint's ignore list
        keeps every DeltaNet projection float (vLLM and transformers match these lists as substrings)."""
        for pattern in self.ignore:
            if "*" in pattern and not pattern.startswith("re:"):  # gpt-oss: "model.layers.*.self_attn"
                parts = module.split(".")
                if any(fnmatch.fnmatchcase(".".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
                    return True
            elif pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return True
            elif f".{pattern}." in f".{module}.":  # a whole dotted part anywhere: "linear_attn", "mlp.gate"
                return True
        return False


def parse_quantization_config(hf: dict[str, Any], override: str | None = None) -> QuantConfig | None:
    """QuantConfig from a config.json dict; `override` (--quantization) must name the folder's own method."""
    qc = hf.get("quantization_config") or hf.get("compression_config")
    if not qc:
        if override is not None:
            raise ValueError(f"--quantization {override} was given but the model folder has no "
                             "quantization_config: it holds float weights; drop --quantization or point --model "
                             "at a quantized checkpoint")
        return None
    method = str(qc.get("quant_method", "<missing>")).lower()
    method = "auto-round" if method == "intel/auto-round" else method  # AutoRound before 0.4 wrote this
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_METHODS)})")
    if override is not None and override != method:
        raise ValueError(f"--quantization {override} does not match the model folder's quant_method {method!r}; "
                         f"drop --quantization or pass --quantization {method}")
    return {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors, "fp8": _fp8,
            "mxfp4": _mxfp4, "auto-round": _auto_round, "gguf": _gguf}[method](qc)


def check_folder_quantization(model: str, override: str) -> None:
    """Early check of --quantization against a local folder's config.json (hub ids are checked at load)."""
    config = Path(model).expanduser() / "config.json"
    if model and config.is_file():
        parse_quantization_config(json.loads(config.read_text()), override)


def _group_size(value: Any, where: str) -> int:
    group = -1 if value in (None, -1, 0) else int(value)
    if group != -1 and (group < 8 or group % 8):
        raise ValueError(f"{where} group_size {value} is not supported (a multiple of 8, or -1)")
    return group


def _awq(qc: dict[str, Any]) -> QuantConfig:
    version = str(qc.get("version", "gemm")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (only 'gemm' checkpoints)")
    if bits != 4:
        raise ValueError(f"AWQ with {bits} bits is not supported (only 4-bit)")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ without zero points (zero_point: false) is not supported")
    group = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), "AWQ")
    return QuantConfig("awq", "int", bits, group, symmetric=False,
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _gptq(qc: dict[str, Any]) -> QuantConfig:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported (4 or 8)")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    if qc.get("dynamic"):
        raise ValueError("GPTQ per-module overrides (quantization_config.dynamic) are not supported")
    if qc.get("lm_head"):
        raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
    return QuantConfig("gptq", "int", bits, _group_size(qc.get("group_size", 128), "GPTQ"),
                       symmetric=bool(qc.get("sym", True)), act_order=bool(qc.get("desc_act", False)),
                       zero_offset=1 if fmt == "gptq" else 0,
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _weight_block(value: Any, where: str) -> tuple[int, int] | None:
    """[rows, cols] of a block-wise FP8 scale, or None (per-tensor / per-channel scales)."""
    if not value:
        return None
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"{where} {value!r} is not two positive integers [rows, cols]")
    return int(value[0]), int(value[1])


def _fp8(qc: dict[str, Any]) -> QuantConfig:
    block = _weight_block(qc.get("weight_block_size"), "FP8 weight_block_size")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 weight format {qc.get('fmt')!r} is not supported (e4m3)")
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    return QuantConfig("fp8", "float", 8, block[1] if block else -1, ignore=ignore, weight_block=block,
                       activation_fp8=qc.get("activation_scheme", "dynamic") == "dynamic")


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config_groups is not supported (exactly one)")
    scheme = next(iter(groups.values()))
    targets = scheme.get("targets") or []
    if targets != ["Linear"]:
        raise ValueError(f"compressed-tensors targets {targets} are not supported (['Linear'])")
    w = scheme.get("weights") or {}
    fmt, wtype, bits = qc.get("format"), w.get("type", "int"), int(w.get("num_bits", 0))
    strategy = w.get("strategy")
    ignore = tuple(qc.get("ignore") or ())
    if fmt == "float-quantized" and wtype == "float" and bits == 8:
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors FP8 strategy {strategy!r} is not supported (tensor, channel, "
                             "block)")
        block = _weight_block(w.get("block_structure"), "compressed-tensors FP8 block_structure") \
            if strategy == "block" else None
        if strategy == "block" and block is None:
            raise ValueError("compressed-tensors FP8 strategy 'block' has no block_structure")
        acts = scheme.get("input_activations") or {}
        return QuantConfig("compressed-tensors", "float", 8, block[1] if block else -1, ignore=ignore,
                           weight_block=block,
                           activation_fp8=acts.get("type") == "float" and bool(acts.get("dynamic")))
    if fmt != "pack-quantized" or wtype != "int" or bits not in (4, 8):
        raise ValueError(f"compressed-tensors format {fmt!r} with {bits}-bit {wtype} weights is not supported "
                         "(pack-quantized int 4/8-bit, float-quantized fp8)")
    if scheme.get("input_activations"):
        raise ValueError("compressed-tensors pack-quantized with quantized activations is not supported "
                         "(weight-only W4A16/W8A16)")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors int strategy {strategy!r} is not supported (group, channel)")
    actorder = w.get("actorder")
    if actorder not in (None, False, "group", "weight", "static"):
        raise ValueError(f"compressed-tensors actorder {actorder!r} is not supported")
    group = _group_size(w.get("group_size") if strategy == "group" else -1, "compressed-tensors")
    return QuantConfig("compressed-tensors", "int", bits, group, symmetric=bool(w.get("symmetric", True)),
                       act_order=actorder == "group", ignore=ignore)


def _mxfp4(qc: dict[str, Any]) -> QuantConfig:
    return QuantConfig("mxfp4", "mxfp4", 4, 32, ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _auto_round(qc: dict[str, Any]) -> QuantConfig:
    """AutoRound's own format: int codes in GPTQ v1 packing (`auto_round:auto_gptq`, its default; older
    checkpoints say `backend: auto_round:gptq:...`) or AWQ gemm packing (`auto_round:auto_awq`), weight-only.
    `extra_config` lists per-module overrides: 16 bits or more keeps a module float (routers, shared-expert
    gates), anything else that differs from the global scheme is refused by name."""
    fmt = str(qc.get("packing_format") or qc.get("backend") or "auto_round:auto_gptq").lower()
    data_type = str(qc.get("data_type", "int")).lower()
    if data_type != "int":
        raise ValueError(f"AutoRound data_type {data_type!r} is not supported (int: its GPTQ/AWQ packings)")
    if qc.get("act_bits") not in (None, 16, 32):
        raise ValueError(f"AutoRound with {qc['act_bits']}-bit activations is not supported (weight-only)")
    bits, group, sym = int(qc.get("bits", 4)), qc.get("group_size", 128), bool(qc.get("sym", True))
    ignore = list(qc.get("modules_to_not_convert") or ())
    for module, override in (qc.get("extra_config") or {}).items():
        override = override or {}
        if int(override.get("bits", bits)) >= 16 or str(override.get("data_type", data_type)).lower() in (
                "float", "fp"):
            ignore.append(module)
        elif (int(override.get("bits", bits)), override.get("group_size", group), bool(override.get("sym", sym))) \
                != (bits, group, sym):
            raise ValueError(f"AutoRound extra_config quantizes {module!r} as {override}, unlike the checkpoint's "
                             f"{bits}-bit group {group} sym={sym}; mixed schemes are not supported")
    if "awq" in fmt:
        if sym:
            raise ValueError("AutoRound AWQ packing with sym: true is not supported (AWQ stores zero points)")
        base = _awq({"bits": bits, "group_size": group, "zero_point": True, "version": "gemm"})
    elif "gptq" in fmt or "exllamav2" in fmt or fmt in ("auto_round", "auto_round:auto_gptq"):
        # auto-round packs zero points the auto-gptq way, stored as zero - 1: GPTQ v1.
        base = _gptq({"bits": bits, "group_size": group, "sym": sym, "desc_act": False, "checkpoint_format": "gptq"})
    else:
        raise ValueError(f"AutoRound packing_format {fmt!r} is not supported (auto_round:auto_gptq, "
                         "auto_round:auto_awq)")
    return replace(base, ignore=tuple(ignore), origin="auto-round")


def _gguf(qc: dict[str, Any]) -> QuantConfig:
    """A GGUF file's types, as engine/config/gguf_config.py writes them: {"quant_method": "gguf", type: bytes}."""
    by_type = sorted(((k, int(v)) for k, v in qc.items() if k != "quant_method"), key=lambda kv: -kv[1])
    if not by_type:
        raise ValueError("a GGUF quantization_config lists no tensor types")
    return QuantConfig("gguf", "gguf", GGUF_BITS.get(by_type[0][0], 16), 32, gguf_bytes=tuple(by_type))
