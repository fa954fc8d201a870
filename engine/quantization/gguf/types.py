"""The GGUF tensor types: every ggml type's name and block geometry, and the ones this engine reads.

A GGUF tensor names its type by llama.cpp's ggml type id; the `gguf` library's table gives each id its name,
weights per block and bytes per block, so a header can be sized and a type we do not read can be refused by
its name (Q2_K, IQ2_XXS, ...) with the list of those we do. `describe_types` turns a file's tensor types into
the short form the app and the planner show ("Q4_K 61%, Q6_K 31%, F32 ..."). Torch-free.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL", "MXFP4")
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True, slots=True)
class GgmlType:
    id: int
    name: str
    block_size: int  # weights per block
    type_size: int  # bytes per block

    @property
    def supported(self) -> bool:
        return self.name in SUPPORTED_TYPES

    def nbytes(self, elements: int) -> int:
        return elements // self.block_size * self.type_size


def ggml_type(type_id: int) -> GgmlType:
    """The type of id `type_id`; a ValueError for an id the `gguf` library does not know either."""
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"GGUF tensor type {type_id} is unknown (to this engine and to gguf-py); supported: "
                         f"{', '.join(SUPPORTED_TYPES)}") from None
    block, size = GGML_QUANT_SIZES[qtype]
    return GgmlType(int(qtype), qtype.name, block, size)


def type_id(name: str) -> int:
    return int(GGMLQuantizationType[name])


def check_supported(tensor: str, type_id_: int) -> GgmlType:
    t = ggml_type(type_id_)
    if not t.supported:
        raise ValueError(f"GGUF tensor {tensor!r} is stored as {t.name}, which this engine does not read; "
                         f"supported: {', '.join(SUPPORTED_TYPES)} (requantize the file, or pick another quant "
                         "of the model)")
    return t


def file_type_name(file_type: int | None) -> str | None:
    """llama.cpp's name for a file's `general.file_type` (15 -> "Q4_K_M"), None when absent or unknown."""
    try:
        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        return None


def is_gguf_model(cfg) -> bool:
    """Whether a ModelConfig comes from a GGUF file (its layers keep the file's blocks)."""
    return cfg.quantization is not None and cfg.quantization.method == "gguf"


def describe_types(bytes_by_type: dict[str, int]) -> str:
    """"Q4_K 61%, Q6_K 31%, F32 <1%": the share of the weight bytes each type holds, largest first."""
    total = sum(bytes_by_type.values()) or 1
    parts = []
    for name, nbytes in Counter(bytes_by_type).most_common():
        share = 100 * nbytes / total
        parts.append(f"{name} {share:.0f}%" if share >= 1 else f"{name} <1%")
    return ", ".join(parts)
