"""MTP heads written into a random hybrid checkpoint (Qwen3.5 / Qwen3-Next) under the published names, shared by
`pagedesk-bench spec` and tests/test_mtp.py: `add_mtp_head` writes a random head (its decoder layer the model's
first full-attention layer with perturbed weights: a head the target rarely agrees with, the lower bound), and
`bigram_with_exact_head` copies a checkpoint into a bigram model with a head that computes exactly the target's
next hidden state (every draft accepted: the upper bound at a given k). Both write `mtp.safetensors` beside the
model's weights, as published checkpoints do: mtp.fc, mtp.pre_fc_norm_embedding / _hidden, mtp.layers.0.*,
mtp.norm.
"""
from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path


def _hf_model(path: Path):
    """The transformers model for a folder, float32 (a VL folder: its image-text-to-text model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vl = "text_config" in json.loads((path / "config.json").read_text())
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


def add_mtp_head(path: Path, seed: int = 1, reference_layer: Path | None = None) -> Path:
    """Write a random MTP head into the checkpoint folder: its decoder layer is the model's first full-attention
    layer (the same module kind) with perturbed weights, saved the way HF saves that layer, under mtp.layers.0.
    `reference_layer`: where to save the perturbed layer's HF module state as well (a test's reference)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    hf = _hf_model(path)
    top = json.loads((path / "config.json").read_text())
    cfg = top.get("text_config", top)  # a VL checkpoint: its text model's
    decoder = getattr(hf.model, "language_model", hf.model)
    layer = cfg["layer_types"].index("full_attention")
    gen = torch.Generator().manual_seed(seed)
    head_layer = copy.deepcopy(decoder.layers[layer])
    with torch.no_grad():
        for p in head_layer.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    if reference_layer is not None:
        torch.save(head_layer.state_dict(), reference_layer)
    decoder.layers[layer] = head_layer
    h = cfg["hidden_size"]
    tensors, prefixes = {}, (f"model.layers.{layer}.", f"model.language_model.layers.{layer}.")
    with tempfile.TemporaryDirectory() as tmp:  # HF's own names for the layer, whatever its module kind
        hf.save_pretrained(tmp, safe_serialization=True)
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    for prefix in prefixes:
                        if name.startswith(prefix):
                            tensors["mtp.layers.0." + name[len(prefix):]] = f.get_tensor(name)
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.1 * torch.randn(h, generator=gen)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return path


def bigram_with_exact_head(src: Path, dst: Path) -> Path:
    """A copy of a Qwen3.5 checkpoint whose layers add nothing to the residual stream (token mixers and MLPs write
    zeros; they still compute, so a step costs what the original's does), so its greedy next token is a function
    of the last token alone — and an MTP head that computes exactly the target's next hidden state (fc takes the
    embedding half, its layer adds nothing, mtp.norm is the final norm): every draft is the target's own next
    token."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    (dst / "mtp.safetensors").unlink(missing_ok=True)
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name in tensors:
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    h = tensors["model.norm.weight"].shape[0]
    layer = f"model.layers.{json.loads((dst / 'config.json').read_text())['layer_types'].index('full_attention')}."
    head = {"mtp.layers.0." + k[len(layer):]: v for k, v in tensors.items() if k.startswith(layer)}
    head["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    head["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)
    head["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(h)
    head["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(head, str(dst / "mtp.safetensors"))
    return dst
