"""Every shard of every parameter is accounted for at load: fused Phi-3 tensors split exactly (float and packed, one
rank and each of two), and a checkpoint with one tensor missing, one extra, or one shard twice is an error naming it."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.distributed.parallel_state import init_tensor_parallel
from engine.worker.loader import iterate_weights
from engine.config.model import ModelConfig
from engine.models.registry import model_class
from quant_packers import dequantize_module, make_quantized


@pytest.fixture(scope="module")
def phi3_dir(tiny_model_dir):
    # K of 128/256: whole groups of 128; 8 heads keep head_dim 16, which the tiny LongRoPE factors fit
    return tiny_model_dir("phi3", hidden_size=128, intermediate_size=256, num_attention_heads=8)


def load_rank(path, rank: int = 0, tp: int = 1):
    init_tensor_parallel(rank, tp)
    try:
        cfg = ModelConfig.from_folder(path)
        model = model_class(cfg.architecture)(cfg)
        model.load_weights(iterate_weights(path))
        return model
    finally:
        init_tensor_parallel(0, 1)


def rank_rows(w: torch.Tensor, sizes: list[int], rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s rows of each stacked matrix of a fused [sum(sizes), K] weight, stacked again."""
    parts = w.split(sizes)
    return torch.cat([p[rank * (p.shape[0] // tp):(rank + 1) * (p.shape[0] // tp)] for p in parts])


def edited_copy(src, dst, edit) -> object:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("fmt", [None, "awq", "gptq-act", "fp8"])
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_phi3_checkpoint_loads_exactly(phi3_dir, tmp_path, fmt, tp):
    path = phi3_dir
    if fmt is not None:
        variant = {"awq": ("awq", 4, 32, False, False), "gptq-act": ("gptq", 4, 32, True, True),
                   "fp8": ("fp8", 8, -1, True, False)}[fmt]
        path = make_quantized(phi3_dir, tmp_path / "q", *variant)
    raw = load_file(str(path / "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in raw or "model.layers.0.self_attn.qkv_proj.qweight" in raw
    qc = json.loads((path / "config.json").read_text()).get("quantization_config")
    modules: dict[str, dict] = {}
    for name, t in raw.items():
        module, leaf = name.rsplit(".", 1)
        modules.setdefault(module, {})[leaf] = t
    cfg = ModelConfig.from_folder(path)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for rank in range(tp):
        model = load_rank(path, rank, tp)
        for i, layer in enumerate(model.model.layers):
            for linear, module, sizes in [(layer.self_attn.qkv_proj, f"model.layers.{i}.self_attn.qkv_proj", [q, kv, kv]),
                                          (layer.mlp.gate_up_proj, f"model.layers.{i}.mlp.gate_up_proj",
                                           [cfg.intermediate_size] * 2)]:
                t = modules[module]
                full = t["weight"] if qc is None else dequantize_module(t, qc)
                assert torch.equal(linear.dequantized_weight(), rank_rows(full.float(), sizes, rank, tp)), \
                    f"{module} rank {rank}/{tp}"


def test_float_weights_equal_hf_after_load(phi3_dir):
    from tiny_models import hf_model
    ours = dict(load_rank(phi3_dir).named_parameters())
    theirs = dict(hf_model(phi3_dir).named_parameters())
    assert set(ours) == set(theirs)
    for name, p in theirs.items():
        assert torch.equal(ours[name], p), name


def test_missing_fused_tensor_is_named(phi3_dir, tmp_path):
    path = edited_copy(phi3_dir, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.qkv_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): model\.layers\.1\.self_attn\.qkv_proj\.weight "
                                         r"\[shards k, q, v\]"):
        load_rank(path)


def test_extra_tensor_is_named(phi3_dir, tmp_path):
    def extra(t):
        t["model.layers.0.self_attn.dense.weight"] = torch.zeros(4, 4)
    path = edited_copy(phi3_dir, tmp_path / "e", extra)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.dense\.weight' this model does not expect"):
        load_rank(path)


def test_wrong_fused_shape_is_named(phi3_dir, tmp_path):
    def shrink(t):
        name = "model.layers.0.mlp.gate_up_proj.weight"
        t[name] = t[name][:-8].contiguous()
    path = edited_copy(phi3_dir, tmp_path / "s", shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_up_proj: fused checkpoint tensor of shape "
                                         r"\(504, 128\) does not stack 2 matrices of \[256, 256\]"):
        load_rank(path)


def test_unfused_checkpoint_missing_one_shard_is_named(llama_dir, tmp_path):
    """The old check counted parameters: a checkpoint without k_proj passed as loaded."""
    path = edited_copy(llama_dir, tmp_path / "k", lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): model\.layers\.0\.self_attn\.qkv_proj\.weight "
                                         r"\[shard k\]"):
        load_rank(path)


def test_a_shard_loaded_twice_is_named(llama_dir, tmp_path):
    def both(t):
        a = "model.layers.0.self_attn."
        t[a + "qkv_proj.weight"] = torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"]])
    path = edited_copy(llama_dir, tmp_path / "d", both)
    with pytest.raises(ValueError, match=r"qkv_proj\.weight \[shard[s]? .*\] a second time"):
        load_rank(path)
