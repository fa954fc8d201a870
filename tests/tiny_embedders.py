"""Tiny random-weight embedding checkpoints for tests, laid out as Qwen3-Embedding ships: the bare decoder's
tensors (`layers.*`, `embed_tokens.*`, `norm.*`, no `model.` prefix and no LM head) under a Qwen3ForCausalLM
config, with sentence-transformers' modules.json, 1_Pooling/config.json and 2_Normalize; and the HF reference
(transformers' bare model: last hidden state, pooled and normalised as sentence-transformers does).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import make_tiny_model

ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


def make_tiny_embedder(tmp_dir: str | Path, pooling: str = "LAST", normalize: bool = True,
                       matryoshka: bool = True, base: str | Path | None = None) -> Path:
    """An embedding folder under tmp_dir; from a copy of `base` (a tiny qwen3 folder) when given."""
    import shutil

    from safetensors.torch import load_file, save_file

    if base is None:
        path = make_tiny_model(Path(tmp_dir) / f"embed-{pooling.lower()}", "qwen3")
    else:
        path = Path(shutil.copytree(base, Path(tmp_dir) / f"embed-{pooling.lower()}"))
    weights = load_file(path / "model.safetensors")
    bare = {name[len("model."):]: t.contiguous() for name, t in weights.items() if name.startswith("model.")}
    save_file(bare, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["is_matryoshka"] = matryoshka
    (path / "config.json").write_text(json.dumps(config))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir()
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pool_config = {"word_embedding_dimension": config["hidden_size"], "include_prompt": True,
                   **{mode: kind == pooling for kind, mode in ST_MODES.items()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool_config))
    return path


def hf_embeddings(path: str | Path, prompts: list[list[int]], pooling: str = "LAST", normalize: bool = True,
                  dimensions: int | None = None) -> list[list[float]]:
    """transformers' bare model on the same folder: each prompt's final hidden states pooled, truncated and
    normalised (float32, one prompt at a time: no padding)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vector = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(0)}[pooling]
            if dimensions is not None:
                vector = vector[:dimensions]
            if normalize:
                vector = torch.nn.functional.normalize(vector, p=2, dim=0)
            out.append(vector.tolist())
    return out
