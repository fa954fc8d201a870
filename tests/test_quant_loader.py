"""Quantized checkpoints load into the engine's layers exactly: dequantized weights equal a direct reading.

Every format, bit width and group size is packed on the fly from a tiny float model (tests/quant_packers.py)
and loaded through the engine's own path (ModelConfig, iterate_weights, load_weights); each stacked layer's
dequantized weight must equal the packer-side dequantization of the checkpoint's tensors, bit for bit, on one
rank and on each of two ranks (built in this process: loading needs no collectives). Unsupported variants and
shapes that cannot be split get clear errors.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.distributed.parallel_state import init_tensor_parallel
from engine.worker.loader import iterate_weights
from engine.config.model import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.quantization.config import parse_quantization_config
from quant_packers import dequantize_module, make_quantized

# (format, bits, group size, symmetric, act order): every family, both widths, groups 32/64/128 and -1.
VARIANTS = [
    ("awq", 4, 32, False, False), ("awq", 4, 64, False, False), ("awq", 4, 128, False, False),
    ("gptq", 4, 32, False, False), ("gptq", 4, 128, True, True), ("gptq", 4, -1, True, False),
    ("gptq", 8, 64, False, True), ("gptq", 8, -1, False, False), ("gptq_v2", 4, 64, False, False),
    ("ct", 4, 32, True, False), ("ct", 4, 64, False, True), ("ct", 8, -1, True, False), ("ct", 8, 128, False, False),
    ("ct-fp8", 8, -1, True, False), ("fp8", 8, -1, True, False),
]
IDS = [f"{f}-w{b}-g{g}-{'sym' if s else 'asym'}{'-act' if a else ''}" for f, b, g, s, a in VARIANTS]


@pytest.fixture(scope="module")
def wide_dir(tiny_model_dir):
    return tiny_model_dir("llama", hidden_size=128, intermediate_size=256)  # K of 128 and 256: whole groups of 128


@pytest.fixture(scope="module")
def quantized(wide_dir, tmp_path_factory):
    """quantized(fmt, bits, group, sym, act, **options) -> packed folder, made once per module."""
    made = {}

    def make(*variant, **kw):
        key = (variant, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_quantized(wide_dir, tmp_path_factory.mktemp("quant") / "q", *variant, **kw)
        return made[key]
    return make


def reference_weights(path) -> dict[str, torch.Tensor]:
    """Checkpoint module name -> float weight [N, K], read without the engine."""
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        module, leaf = name.rsplit(".", 1)
        modules.setdefault(module, {})[leaf] = t
    return {m: (dequantize_module(t, qc) if "weight" not in t or t["weight"].dtype == torch.float8_e4m3fn
                else t["weight"]) for m, t in modules.items() if "proj" in m}


def load_rank(path, rank: int, tp: int) -> LlamaForCausalLM:
    init_tensor_parallel(rank, tp)
    try:
        model = LlamaForCausalLM(ModelConfig.from_folder(path))
        model.load_weights(iterate_weights(path))
        return model
    finally:
        init_tensor_parallel(0, 1)


def expected_shard(ref: dict[str, torch.Tensor], prefix: str, kind: str, rank: int, tp: int) -> torch.Tensor:
    def rows(name):
        w = ref[f"{prefix}.{name}"]
        size = w.shape[0] // tp
        return w[rank * size:(rank + 1) * size]
    if kind == "qkv":
        return torch.cat([rows("q_proj"), rows("k_proj"), rows("v_proj")])
    if kind == "gate_up":
        return torch.cat([rows("gate_proj"), rows("up_proj")])
    w = ref[f"{prefix}.{kind}"]
    size = w.shape[1] // tp
    return w[:, rank * size:(rank + 1) * size]


def assert_layers_match(model, ref, rank: int, tp: int) -> None:
    for i, layer in enumerate(model.model.layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for linear, prefix, kind in [(layer.self_attn.qkv_proj, attn, "qkv"), (layer.self_attn.o_proj, attn, "o_proj"),
                                     (layer.mlp.gate_up_proj, mlp, "gate_up"), (layer.mlp.down_proj, mlp, "down_proj")]:
            expected = expected_shard(ref, prefix, kind, rank, tp)
            assert torch.equal(linear.dequantized_weight(), expected), f"{prefix} {kind} rank {rank}/{tp}"


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_dequantized_weights_equal_direct_dequantization(quantized, variant):
    path = quantized(*variant)
    model = load_rank(path, 0, 1)
    assert_layers_match(model, reference_weights(path), 0, 1)
    packed = model.model.layers[0].mlp.down_proj
    assert all(p.dtype != torch.float32 or p.dim() < 2 or p.shape[0] < 64 for p in packed.parameters()), \
        "weights must stay packed in memory"


TP_VARIANTS = (0, 4, 7, 10, 13)  # AWQ, GPTQ act order, GPTQ one group, compressed-tensors act order + zeros, FP8


@pytest.mark.parametrize("variant", [VARIANTS[i] for i in TP_VARIANTS], ids=[IDS[i] for i in TP_VARIANTS])
def test_tensor_parallel_shards_equal_slices(quantized, variant):
    """Column-parallel layers slice output features, row-parallel layers input features at group boundaries;
    act order keeps every group's scales on each rank and slices g_idx."""
    path = quantized(*variant)
    ref = reference_weights(path)
    for rank in range(2):
        assert_layers_match(load_rank(path, rank, 2), ref, rank, 2)


def test_ignored_modules_and_lm_head_stay_float(quantized):
    path = quantized("awq", 4, 64, False, False, ignore=("model.layers.1.mlp.down_proj",))
    model = load_rank(path, 0, 1)
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.down_proj.qweight.dtype == torch.int32
    assert_layers_match(model, reference_weights(path), 0, 1)


def test_groups_that_cannot_be_split_give_a_clear_error(quantized):
    path = quantized("gptq", 4, 128, False, False)  # o_proj has 128 inputs: 64 per rank is half a group
    with pytest.raises(ValueError, match=r"o_proj: 64 input features per rank do not hold whole groups of 128"):
        load_rank(path, 0, 2)


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 128}, "AWQ version 'gemv'"),
    ({"quant_method": "awq", "version": "gemm", "bits": 3, "group_size": 128}, "AWQ with 3 bits"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\] is not two positive"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "format 'int-quantized' with 8-bit int"),
    ({"quant_method": "auto-round", "bits": 4, "data_type": "mx_fp"}, "AutoRound data_type 'mx_fp'"),
    ({"quant_method": "auto-round", "bits": 4, "packing_format": "auto_round:llm_compressor"},
     "packing_format 'auto_round:llm_compressor'"),
    ({"quant_method": "auto-round", "bits": 4, "group_size": 128, "extra_config": {
        "model.layers.0.mlp.down_proj": {"bits": 8}}}, r"quantizes 'model.layers.0.mlp.down_proj' as \{'bits': 8\}"),
])
def test_unsupported_variants_name_what_they_found(qc, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config({"quantization_config": qc})


def test_auto_round_reads_as_its_packing():
    """AutoRound's default export is GPTQ v1 packing (zero points stored minus one), `auto_round:auto_awq` AWQ;
    modules its extra_config keeps at 16 bits are ignored (float); the pre-0.4 `intel/auto-round` name too."""
    gptq = parse_quantization_config({"quantization_config": {
        "quant_method": "intel/auto-round", "bits": 4, "group_size": 128, "sym": True,
        "backend": "auto_round:gptq:exllamav2", "extra_config": {"model.layers.0.mlp.gate": {"bits": 16}}}})
    assert (gptq.method, gptq.zero_offset, gptq.symmetric, gptq.act_order) == ("gptq", 1, True, False)
    assert gptq.is_ignored("model.layers.0.mlp.gate") and not gptq.is_ignored("model.layers.0.mlp.experts")
    assert gptq.describe() == "auto-round (gptq packing) 4-bit g128"
    awq = parse_quantization_config({"quantization_config": {
        "quant_method": "auto-round", "bits": 4, "group_size": 64, "sym": False,
        "packing_format": "auto_round:auto_awq"}})
    assert (awq.method, awq.group_size, awq.symmetric) == ("awq", 64, False)


def test_quantization_flag_only_confirms_the_folder(quantized, wide_dir):
    path = quantized("awq", 4, 64, False, False)
    assert ModelConfig.from_folder(path, "awq").quantization.describe() == "awq 4-bit g64 asym"
    with pytest.raises(ValueError, match="does not match the model folder's quant_method 'awq'"):
        ModelConfig.from_folder(path, "gptq")
    with pytest.raises(ValueError, match="has no quantization_config"):
        ModelConfig.from_folder(wide_dir, "awq")


def test_a_tensor_of_the_wrong_shape_is_named(quantized):
    path = quantized("awq", 4, 64, False, False)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.scales"] = tensors["model.layers.0.mlp.up_proj.scales"][:, :8]
    model = LlamaForCausalLM(ModelConfig.from_folder(path))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj/up_proj: checkpoint tensor of shape \(2, 8\)"):
        model.load_weights(tensors.items())


def test_fp8_block_scales_load_and_split_across_ranks(quantized):
    """Block-wise FP8 (weight_scale_inv per [48, 32] block here): row blocks of 48 straddle the ranks' output
    slices (64 rows of q_proj each) and merged q/k/v and gate/up, which the per-row expansion of the scales
    makes no matter; row-parallel layers take whole column blocks of their input slice."""
    path = quantized("fp8", 8, -1, True, False, block=(48, 32))
    ref = reference_weights(path)
    assert_layers_match(load_rank(path, 0, 1), ref, 0, 1)
    for rank in range(2):
        assert_layers_match(load_rank(path, rank, 2), ref, rank, 2)
    with pytest.raises(ValueError, match=r"o_proj: 32 input features per rank do not hold whole FP8 blocks of 48"):
        load_rank(quantized("fp8", 8, -1, True, False, block=(16, 48)), 0, 4)
