"""SpeculativeConfig: vLLM's `speculative_config` (a dict, or JSON on the command line), parsed and checked.

Torch-free (the flag definitions import it). Three methods are built: "ngram" (prompt lookup: the tokens
that followed the latest earlier occurrence of the sequence's last n tokens), "draft_model" (a small
model with the target's vocabulary, named by "model") and "mtp" (the multi-token-prediction head that
Qwen3-Next and Qwen3.5/3.6 checkpoints carry under `mtp.*`). Anything else, or a bad value, is a ValueError
naming the field, which the CLI turns into exit 2. Whether the target has an MTP head (`check_mtp_head`: a
family the registry knows to carry one, and mtp.* tensors in the checkpoint's names) is checked by the
engine before it loads anything, and by the app's settings form with the same function.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

from engine.models.registry import mtp_head

METHODS = ("ngram", "draft_model", "mtp")
NOT_BUILT = {"eagle": "EAGLE heads are not built", "eagle3": "EAGLE-3 heads are not built",
             "medusa": "Medusa heads are not built"}
KNOWN_FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                "draft_tensor_parallel_size")
MTP_PREFIX = "mtp."  # the checkpoint's multi-token-prediction head: mtp.fc, mtp.layers.N.*, mtp.norm, ...
MAX_SPECULATIVE_TOKENS = 16  # a verify step's rows grow with k; past this acceptance never pays for them


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0  # ngram only
    prompt_lookup_min: int = 0
    model: str | None = None  # draft_model only: the draft's folder or hub repo id

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    def describe(self) -> str:
        if self.method == "ngram":
            return f"ngram k={self.k} lookup {self.prompt_lookup_min}..{self.prompt_lookup_max}"
        if self.method == "mtp":
            return f"the checkpoint's MTP head k={self.k}"
        return f"draft model {self.model} k={self.k}"


def _field(name: str) -> str:
    return f"speculative_config.{name}"


def _int(raw: dict, name: str, default: int | None, minimum: int) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ValueError(f"{_field(name)} is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_field(name)} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{_field(name)} must be >= {minimum}, got {value}")
    return value


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """None (off), a dict or its JSON text -> a checked SpeculativeConfig; ValueError names the bad field."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc.msg} at character {exc.pos}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KNOWN_FIELDS))
    if unknown:
        raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {list(KNOWN_FIELDS)}")
    method = value.get("method")
    if method is None:
        if not value.get("model"):
            raise ValueError("speculative_config.method is required (\"ngram\"), or speculative_config.model "
                             "for a draft model")
        method = "draft_model"
    if method in NOT_BUILT:
        raise ValueError(f"speculative_config.method {method!r} is not supported: {NOT_BUILT[method]}; "
                         f"built: {list(METHODS)}")
    if method not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {method!r}")
    k = _int(value, "num_speculative_tokens", None, 1)
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{_field('num_speculative_tokens')} must be <= {MAX_SPECULATIVE_TOKENS}, got {k}")
    tp = _int(value, "draft_tensor_parallel_size", 1, 1)
    if tp != 1:
        raise ValueError(f"{_field('draft_tensor_parallel_size')} must be 1 (the draft runs whole on rank 0, "
                         f"also under tensor parallel), got {tp}")
    if method == "ngram":
        if value.get("model"):
            raise ValueError("speculative_config.model is only for a draft model; method \"ngram\" takes none")
        hi = _int(value, "prompt_lookup_max", 3, 1)
        lo = _int(value, "prompt_lookup_min", min(hi, 1), 1)
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) is more than prompt_lookup_max ({hi})")
        return SpeculativeConfig("ngram", k, hi, lo)
    for name in ("prompt_lookup_max", "prompt_lookup_min"):
        if name in value:
            raise ValueError(f"{_field(name)} is only for method \"ngram\"")
    if method == "mtp":
        if value.get("model"):
            raise ValueError("speculative_config.model is only for a draft model; method \"mtp\" uses the head in "
                             "the target's own checkpoint")
        return SpeculativeConfig("mtp", k)
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config.model must name the draft model's folder or hub repo id")
    return SpeculativeConfig("draft_model", k, model=model)


def check_draft_vocab(target_vocab: int, draft_vocab: int, target_tokenizer, draft_tokenizer) -> None:
    """A draft proposes token ids the target verifies: both must mean the same thing by every id."""
    if target_vocab != draft_vocab:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {draft_vocab} tokens, the "
                         f"target's {target_vocab}; a draft model needs the target's tokenizer and vocabulary")
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ValueError("speculative_config.model: the draft's tokenizer maps tokens to other ids than the "
                             "target's; a draft model needs the target's tokenizer")


def check_mtp_head(architecture: str, text_config: dict, names: Iterable[str], where: str = "the checkpoint") -> int:
    """The number of MTP layers (`mtp.layers.N.*`) the target checkpoint carries for method "mtp"; ValueError
    naming speculative_config.method when its family declares no head (the registry's `mtp_head`), or the checkpoint (`where`)
    has no mtp.* tensors, or fewer or more layers than its config states (mtp_num_hidden_layers, Qwen3.5's name,
    or num_nextn_predict_layers, vLLM's for Qwen3-Next)."""
    field = "speculative_config.method \"mtp\""
    mtp_head(architecture)  # the family declares a head (engine/models/registry.py), else a ValueError naming it
    indices = {int(name.split(".")[2]) for name in names if name.startswith(MTP_PREFIX + "layers.")}
    if not indices:
        raise ValueError(f"{field}: {where} has no MTP weights (no mtp.* tensors); use method \"ngram\" or a "
                         "draft model")
    stated = text_config.get("mtp_num_hidden_layers", text_config.get("num_nextn_predict_layers"))
    if stated is not None and len(indices) != int(stated):
        raise ValueError(f"{field}: the checkpoint has {len(indices)} MTP layer(s) (mtp.layers.*), the config "
                         f"states {stated}")
    return len(indices)
