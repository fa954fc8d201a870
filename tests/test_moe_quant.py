"""Quantized MoE checkpoints (AWQ, GPTQ — act order too —, AutoRound, compressed-tensors and FP8 experts, packed
by the tests' own packers) equal HF running the dequantized float model: greedy token ids identical. The router
stays float, as published checkpoints keep it (AutoRound lists it in extra_config as 16-bit)."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from hf_reference import engine_greedy, hf_greedy, make_prompts
from kernels.moe_torch import fused_moe_torch
from quant_packers import dequantized_folder, make_quantized

PICKS, MAX_TOKENS = [1, 4, 6], [10, 6, 8]


EXPERT_LEAF = {"awq": "qweight", "gptq": "qweight", "auto-round": "qweight", "ct": "weight_packed"}


@pytest.mark.parametrize("fmt,sym", [("awq", False), ("gptq", False), ("auto-round", True), ("ct", True)])
def test_quantized_experts_match_hf_on_the_dequantized_model(tiny_model_dir, tmp_path, fmt, sym):
    packed = make_quantized(tiny_model_dir("qwen3_moe"), tmp_path / fmt, fmt, bits=4, group=32, sym=sym)
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert f"model.layers.0.mlp.experts.3.down_proj.{EXPERT_LEAF[fmt]}" in names
    assert "model.layers.0.mlp.gate.weight" in names
    prompts = [make_prompts(400)[i] for i in PICKS]
    expected = hf_greedy(dequantized_folder(packed, tmp_path / f"{fmt}-float"), prompts, MAX_TOKENS)
    assert engine_greedy(packed, prompts, MAX_TOKENS) == expected


# Qwen3-30B-A3B-FP8's layout at tiny scale: every linear (attention and experts) e4m3 with one float32
# `weight_scale_inv` per block; blocks of [16, 48] leave partial blocks (K 64, 32 and 128 are not multiples of 48).
FP8_CASES = [("fp8", (16, 48), "weight_scale_inv"), ("ct-fp8", None, "weight_scale")]


@pytest.mark.parametrize("fmt,block,scale_leaf", FP8_CASES, ids=["fp8-block", "ct-fp8-channel"])
def test_fp8_experts_match_hf_on_the_dequantized_model(tiny_model_dir, tmp_path, fmt, block, scale_leaf):
    packed = make_quantized(tiny_model_dir("qwen3_moe"), tmp_path / fmt, fmt, block=block,
                            strategy="block" if block else "channel")
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.experts.5.up_proj.weight").dtype == torch.float8_e4m3fn
        scale = f.get_tensor(f"model.layers.1.mlp.experts.5.up_proj.{scale_leaf}")
        assert f.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.float32  # the router stays float
    assert tuple(scale.shape) == ((2, 2) if block else (32, 1))  # up_proj [32, 64]: 2 x 2 blocks of 16 x 48
    prompts = [make_prompts(400)[i] for i in PICKS]
    expected = hf_greedy(dequantized_folder(packed, tmp_path / f"{fmt}-float"), prompts, MAX_TOKENS)
    assert engine_greedy(packed, prompts, MAX_TOKENS) == expected


def test_fp8_block_configs_read_as_published():
    """Qwen3-30B-A3B-FP8's quantization_config, and compressed-tensors' block strategy (its scales are called
    weight_scale): one scale per 128 x 128 block, group_size the block's columns."""
    from engine.quantization.config import parse_quantization_config
    from engine.quantization.methods import fp8_scale_name
    qwen = parse_quantization_config({"quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"]}})
    assert (qwen.weight_type, qwen.weight_block, qwen.group_size, fp8_scale_name(qwen)) == \
        ("float", (128, 128), 128, "weight_scale_inv")
    assert qwen.describe() == "fp8 e4m3 weights 128x128 blocks, fp8 activations"
    ct = parse_quantization_config({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                               "block_structure": [128, 128]}}}}})
    assert (ct.weight_block, fp8_scale_name(ct)) == ((128, 128), "weight_scale")


def test_gptq_act_order_experts_match_hf_on_the_dequantized_model(tiny_model_dir, tmp_path):
    """desc_act: every expert's rows are dealt to groups in its own order (its g_idx); the dense attention
    layers' act order too, as the dense GPTQ path runs it."""
    packed = make_quantized(tiny_model_dir("qwen3_moe"), tmp_path / "act", "gptq", bits=4, group=16, act_order=True)
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        g0, g3 = (f.get_tensor(f"model.layers.0.mlp.experts.{e}.down_proj.g_idx") for e in (0, 3))
    assert not torch.equal(g0, g3) and not torch.equal(g0, torch.arange(32, dtype=g0.dtype) // 16)
    prompts = [make_prompts(400)[i] for i in PICKS]
    expected = hf_greedy(dequantized_folder(packed, tmp_path / "act-float"), prompts, MAX_TOKENS)
    assert engine_greedy(packed, prompts, MAX_TOKENS) == expected


@pytest.mark.parametrize("fmt", ["gptq", "ct"])
def test_act_order_experts_split_across_ranks(tiny_model_dir, tmp_path, fmt):
    """Tensor parallel 2 on act-order experts (GPTQ desc_act; compressed-tensors actorder "group", whose g_idx
    is `weight_g_idx`): each rank keeps every group's scales and zeros and its rows of down's g_idx, the two
    ranks' partial sums equal the unsplit layer, and that equals the float experts the test's own reader
    dequantizes. Only layer 0's FusedMoE is built and loaded, from the checkpoint's own tensors."""
    from engine.distributed.parallel_state import init_tensor_parallel
    packed = make_quantized(tiny_model_dir("qwen3_moe"), tmp_path / "act", fmt, bits=4, group=16, act_order=True,
                            sym=fmt == "ct")
    g_idx = "w2_g_idx" if fmt == "gptq" else "w2_weight_g_idx"
    scales = "w2_scales" if fmt == "gptq" else "w2_weight_scale"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    weights, ids = torch.softmax(torch.randn(5, 8, generator=gen), -1).topk(2)
    outs = []
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        init_tensor_parallel(rank, size)
        try:
            experts = _layer0_experts(packed)
            if size == 2:
                assert getattr(experts, scales).shape == (8, 2, 64) and getattr(experts, g_idx).shape == (8, 16)
            outs.append(experts(x, weights, ids))
        finally:
            init_tensor_parallel(0, 1)
    torch.testing.assert_close(outs[1] + outs[2], outs[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[0], fused_moe_torch(x, *_layer0_float_experts(packed), weights, ids), atol=1e-4,
                               rtol=1e-4)


def _layer0_float_experts(path):
    """w13 [E, 2I, H] and w2 [E, H, I] dequantized by the test's own reader (quant_packers), not the engine's."""
    import json
    from quant_packers import dequantize_module
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        def weight(e, proj):
            module = f"model.layers.0.mlp.experts.{e}.{proj}"
            return dequantize_module({k.rsplit(".", 1)[1]: f.get_tensor(k) for k in f.keys()
                                      if k.rsplit(".", 1)[0] == module}, qc)
        w13 = torch.stack([torch.cat([weight(e, "gate_proj"), weight(e, "up_proj")]) for e in range(8)])
        w2 = torch.stack([weight(e, "down_proj") for e in range(8)])
    return w13, w2


def _layer0_experts(path):
    from engine.layers.fused_moe import FusedMoE
    from engine.layers.fused_moe.weights import expert_shard
    from engine.config.model import ModelConfig
    from engine.quantization.methods import skipped_tensor
    cfg = ModelConfig.from_folder(path)
    prefix = "model.layers.0.mlp.experts"
    experts = FusedMoE(8, 64, 32, prefix=prefix, quant=cfg.quantization)
    params = dict(experts.named_parameters())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            hit = expert_shard(name) if name.startswith(prefix + ".") and not skipped_tensor(cfg.quantization,
                                                                                             name) else None
            if hit is not None:
                param = params[hit[0].removeprefix(prefix + ".")]
                param.weight_loader(param, f.get_tensor(name), hit[2], hit[1])
    return experts


@pytest.mark.parametrize("fmt", ["awq", "gptq-8bit", "ct", "mxfp4", "fp8-block"])
def test_planner_counts_exactly_the_packed_experts_loaded(tiny_model_dir, tmp_path, fmt):
    """The planner's bytes equal the loaded parameters and buffers: experts stay packed in memory (int32 words,
    float16 scales and a byte per 4-bit zero point, int16 per 8-bit; compressed-tensors' float32 scales and its
    implied zero points; MXFP4 bytes and E8M0 scales), attention and routers as the checkpoint keeps them."""
    from engine.worker.loader import iterate_weights
    from engine.config.model import ModelConfig
    from engine.models.registry import model_class
    from engine.planning.weights import weights_bytes_per_card
    from quant_packers import make_mxfp4_gpt_oss
    if fmt == "mxfp4":
        path = make_mxfp4_gpt_oss(tiny_model_dir("gpt_oss"), tmp_path / fmt)
    elif fmt == "fp8-block":  # blocks dividing every K, so the planner's per-block count is exact
        path = make_quantized(tiny_model_dir("qwen3_moe"), tmp_path / fmt, "fp8", block=(16, 32))
    else:
        path = make_quantized(tiny_model_dir("qwen3_moe"), tmp_path / fmt, "gptq" if fmt == "gptq-8bit" else fmt,
                              bits=8 if fmt == "gptq-8bit" else 4, group=32, sym=fmt == "ct")
    cfg = ModelConfig.from_folder(path)
    model = model_class(cfg.architecture)(cfg)
    model.load_weights(iterate_weights(path))
    experts = model.model.layers[0].mlp.experts
    packed = {n: t.dtype for n, t in [*experts.named_buffers(), *experts.named_parameters()]}
    if fmt == "mxfp4":
        assert packed["w13_blocks"] == packed["w2_scales"] == torch.uint8
    elif fmt == "fp8-block":
        assert packed["w13_weight"] == torch.float8_e4m3fn and packed["w2_weight_scale_inv"] == torch.float32
    else:
        assert packed[f"w13_{'weight_packed' if fmt == 'ct' else 'qweight'}"] == torch.int32
    # buffers: compressed-tensors' implied zero points count; RoPE tables are rope_table_bytes, not weights
    buffers = [b for name, b in model.named_buffers() if "rotary" not in name and "rope" not in name]
    loaded = sum(t.numel() * t.element_size() for t in [*model.parameters(), *buffers])
    assert weights_bytes_per_card(cfg, 4) == loaded
