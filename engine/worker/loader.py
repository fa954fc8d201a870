"""Find a model folder (local path or hub repo id) or GGUF file, and stream a folder's safetensors weights.

A hub id is resolved through huggingface_hub: the local cache first, then a download of config,
tokenizer and *.safetensors files only. Sharded checkpoints are read through their index file, one shard
at a time, so peak memory stays near one shard.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from engine.config.gguf_file import is_gguf

MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    path = Path(model).expanduser()
    if is_gguf(path) and path.is_file():  # a GGUF file (or any part of a split set): read by gguf_loader.py
        return path
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json; point --model at a Hugging Face model folder")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"model {model!r} is neither a local model folder nor a hub repo id (owner/name)")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=MODEL_FILE_PATTERNS,
                                      local_files_only=True))
    except Exception:
        return Path(snapshot_download(model, revision=revision, allow_patterns=MODEL_FILE_PATTERNS))


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def iterate_weights(path: Path, device: str = "cpu", prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, with a progress bar over shards when there are several; with
    `prefix`, only the tensors whose names start with it (the others are never read)."""
    files = safetensors_files(path)
    for file in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=len(files) < 2 or bool(prefix)):
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)


def tensor_names(path: Path) -> list[str]:
    """The checkpoint's tensor names, from the index or the shards' headers (no tensor is read)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    names = []
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names += list(f.keys())
    return names
