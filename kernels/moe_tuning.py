"""Fused-MoE tiles: the built-in default table, and a tuned JSON table per device name that `pagedesk-bench
moe-tune` writes and kernels/triton_moe.py reads (`moe_tiles` picks: the tuned entry when there is one, else the
default). The table maps a device name (``torch.cuda.get_device_name``, e.g. "NVIDIA GeForce RTX 3090") and a
shape key ``"<weights> E<experts> H<hidden> I<intermediate per rank> k<top_k>"`` (weights: fp16/bf16/fp32 for
float experts, else int4/int8/fp8/mxfp4) to the best tiles per timed batch size, each MoETiles' fields in order:
``{"version": 1, "devices": {"NVIDIA GeForce RTX 3090": {"bf16 E128 H2048 I768 k8": {"1": [16, 64, 128, 1, 4,
4], "64": [32, 64, 64, 8, 4, 3]}}}}``. A step of T tokens takes the entry of the nearest timed batch; up to 16
tokens only an entry whose BLOCK_M holds all of them (so each expert's weights are still read once), else the
default. The file is ``$PAGEDESK_MOE_TILES`` or ``~/.cache/pagedesk/moe_tiles.json``, read once per process
(restart the engine after a tuning run). Imports neither torch nor triton.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

TABLE_VERSION = 1
ENV_PATH = "PAGEDESK_MOE_TILES"
DECODE_TOKENS = 16  # up to this many tokens a tile must hold every row of an expert in one M block


@dataclass(frozen=True, slots=True)
class MoETiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def default_moe_tiles(num_tokens: int, top_k: int, num_experts: int, weights: str = "") -> MoETiles:
    """Untuned defaults by rows per expert; BLOCK_M 16 up to 16 tokens (an expert gets each token at most once,
    so one M block holds all its rows and its weights are read once). Shared memory stays under sm_86's 99 KB
    and no configuration spills registers on sm_86/sm_89 (kernels/compile_check.py): FP8 experts' large tiles
    take BLOCK_K 32, since a 64 x 128 tile of decoded FP8 weights next to the accumulator spilled 120 B; GGUF experts
    too (untuned: no card here to tune on)."""
    if weights == "gguf":  # decoded weight by weight (kernels/triton_gguf.py): one 32-wide sub-block a K step
        return MoETiles(16 if num_tokens <= DECODE_TOKENS else 32, 64, 32, 1 if num_tokens <= DECODE_TOKENS else 8,
                        4, 3)
    if num_tokens <= DECODE_TOKENS:
        return MoETiles(16, 64, 128, 1, 4, 4)
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 32:
        return MoETiles(32, 64, 64, 8, 4, 3)
    return MoETiles(64, 128, 32 if weights == "fp8" else 64, 8, 8, 3)


def moe_tiles(device: str, key: str, num_tokens: int, top_k: int, num_experts: int, weights: str = "") -> MoETiles:
    """What a step of `num_tokens` runs with: the tuned entry for this device and shape, else the default."""
    return tuned_tiles(device, key, num_tokens) or default_moe_tiles(num_tokens, top_k, num_experts, weights)


def table_path() -> Path:
    return Path(os.environ.get(ENV_PATH) or Path.home() / ".cache" / "pagedesk" / "moe_tiles.json")


def shape_key(weights: str, experts: int, hidden: int, intermediate: int, top_k: int) -> str:
    return f"{weights} E{experts} H{hidden} I{intermediate} k{top_k}"


def read_table(path: Path) -> dict:
    """The whole table ({} for a missing file); a malformed file is an error naming it."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"MoE tile table {path}: cannot read it ({exc}); delete it or rerun pagedesk-bench "
                         "moe-tune") from exc
    if not isinstance(data, dict) or data.get("version") != TABLE_VERSION or not isinstance(data.get("devices"),
                                                                                             dict):
        raise ValueError(f"MoE tile table {path}: not a version-{TABLE_VERSION} table ({{'version': "
                         f"{TABLE_VERSION}, 'devices': {{...}}}}); delete it or rerun pagedesk-bench moe-tune")
    return data["devices"]


def write_entries(path: Path, device: str, key: str, best: dict[int, MoETiles]) -> None:
    """Merge one shape's tuned batches into the table (other devices and shapes kept), written atomically."""
    devices = read_table(path)
    shape = devices.setdefault(device, {}).setdefault(key, {})
    for tokens, tiles in best.items():
        shape[str(tokens)] = list(tiles_fields(tiles))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"version": TABLE_VERSION, "devices": devices}, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    loaded_table.cache_clear()


def tiles_fields(t: MoETiles) -> tuple[int, ...]:
    return (t.block_m, t.block_n, t.block_k, t.group_m, t.num_warps, t.num_stages)


@functools.cache
def loaded_table(path: str) -> dict:
    return read_table(Path(path))


def tuned_tiles(device: str, key: str, num_tokens: int, path: Path | None = None) -> MoETiles | None:
    """The tuned tiles for a step of `num_tokens` on `device` for `key`, or None (use the default)."""
    entries = loaded_table(str(path or table_path())).get(device, {}).get(key)
    if not entries:
        return None
    usable = []
    for tokens, fields in entries.items():
        tiles = MoETiles(*(int(f) for f in fields))
        if num_tokens <= DECODE_TOKENS and tiles.block_m < num_tokens:
            continue  # would split an expert's rows over two M blocks: its weights read twice
        usable.append((abs(int(tokens) - num_tokens), int(tokens), tiles))
    return min(usable)[2] if usable else None
