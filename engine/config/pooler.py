"""How an embedding checkpoint pools its hidden states, read from its folder; and which task an engine runs.

Torch-free (the app's settings and the planner may read it). A sentence-transformers folder says it with
`modules.json` (a Transformer, then a Pooling module whose folder's `config.json` names the mode, then
optionally Normalize); Qwen3-Embedding ships exactly that (last-token pooling, normalised). Without those
files a decoder embedder pools its last token and normalises (vLLM's default). Matryoshka truncation
(`dimensions`) is allowed only where config.json says the model was trained for it (`matryoshka_dimensions`
or `is_matryoshka`, the flags vLLM reads). Modes we cannot reproduce exactly (max, sqrt-length mean,
weighted mean, a Dense projection after pooling) are refused at start, never served approximately.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.config.gguf_file import is_gguf

TASKS = ("auto", "generate", "embed")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                    "pooling_mode_cls_token": "CLS"}
ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens")
ST_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"  # one of POOLING_TYPES
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes it was trained at; None: any (see below)
    is_matryoshka: bool = False  # `dimensions` may truncate

    @property
    def needs_every_token(self) -> bool:
        """Mean and CLS pooling read hidden states a prefix-cache hit would skip: such requests compute all."""
        return self.pooling_type != "LAST"

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """Raise ValueError naming `dimensions` unless the model can be truncated to it."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError(f"dimensions must be left out: this model does not support truncated embeddings (its "
                             f"config.json marks no Matryoshka training; its embeddings have {hidden_size} "
                             "dimensions)")
        if not 1 <= dimensions <= hidden_size:
            raise ValueError(f"dimensions must be between 1 and {hidden_size}, got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}")


def _sentence_transformers(folder: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from modules.json, or None if the folder has no Pooling module."""
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unknown = [k for k in kinds if k not in ST_KNOWN_MODULES]
    if unknown:
        raise ValueError(f"{modules_file}: sentence-transformers modules {unknown} are not supported (only "
                         f"{list(ST_KNOWN_MODULES)}); their output would differ from the reference")
    pooling = [m for m, k in zip(modules, kinds) if k == "Pooling"]
    if not pooling:
        return None
    config_file = folder / pooling[0].get("path", "1_Pooling") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    bad = [mode for mode in ST_UNSUPPORTED_MODES if config.get(mode)]
    chosen = [kind for mode, kind in ST_POOLING_MODES.items() if config.get(mode)]
    if bad or len(chosen) != 1:
        raise ValueError(f"{config_file}: exactly one of {list(ST_POOLING_MODES)} must be true (got "
                         f"{chosen or 'none'}{', and unsupported ' + str(bad) if bad else ''})")
    if config.get("include_prompt") is False:
        raise ValueError(f"{config_file}: include_prompt false (pooling that skips an instruction prefix) "
                         "is not supported")
    return chosen[0], "Normalize" in kinds


def read_pooler_config(folder: str | Path, hf_config: dict) -> PoolerConfig:
    folder = Path(folder)
    pooling_type, normalize = _sentence_transformers(folder) or ("LAST", True)
    dims = hf_config.get("matryoshka_dimensions")
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize,
                        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
                        is_matryoshka=bool(dims) or bool(hf_config.get("is_matryoshka", False)))


def is_embedding_checkpoint(folder: str | Path, hf_config: dict) -> bool:
    """A sentence-transformers folder with a Pooling module, or a bare `...Model` architecture (no LM head)."""
    folder = Path(folder)
    architecture = (hf_config.get("architectures") or [""])[0]
    if architecture.endswith("Model"):
        return True
    try:
        return _sentence_transformers(folder) is not None
    except ValueError:
        return True  # an embedding folder we cannot serve: the embed path names the problem


def resolve_task(task: str, folder: str | Path) -> str:
    """"generate" or "embed": `--task auto` follows the checkpoint (is_embedding_checkpoint)."""
    if task not in TASKS:
        raise ValueError(f"--task must be one of {list(TASKS)}, got {task!r}")
    if task != "auto":
        return task
    if is_gguf(folder):  # the GGUF families served here are causal LMs
        return "generate"
    hf = json.loads((Path(folder) / "config.json").read_text())
    return "embed" if is_embedding_checkpoint(folder, hf) else "generate"


def pooler_for_task(task: str, folder: str | Path, hf_config: dict, speculative: bool) -> PoolerConfig | None:
    """The engine's pooler under `--task` (None: a generation engine)."""
    if resolve_task(task, folder) != "embed":
        return None
    if speculative:
        raise ValueError("--speculative-config: an embedding engine (--task embed) generates no tokens to "
                         "speculate on; leave it out")
    return read_pooler_config(folder, hf_config)


def task_mismatch(pooler: PoolerConfig | None, embedding: bool) -> str | None:
    """Why an engine refuses a request of the other kind, or None when it serves it."""
    if embedding and pooler is None:
        return ("this model is served for text generation, not embeddings; start the server with --task embed "
                "to serve embeddings from it (pooled final hidden states), or serve an embedding checkpoint")
    if not embedding and pooler is not None:
        return ("this model is served for embeddings (--task embed): use /v1/embeddings; it generates no text")
    return None
