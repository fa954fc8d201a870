"""The MoE block (router, experts, shared experts) against the HF modules it replaces, on the same random weights.

Each family's HF block (Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, GptOssMLP, Glm4MoeMoE) is built from a
tiny config, its weights are fed through our loaders the way a checkpoint would be, and outputs must match in
float32. Tensor parallel is checked in-process: each "rank" builds its shard and the partial sums, added as the
all-reduce would, equal the single-rank output. Uneven splits and missing expert tensors are clear errors.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from engine.distributed.parallel_state import init_tensor_parallel
from engine.layers.fused_moe import RouterSpec, SparseMoeBlock, select_experts
from engine.layers.fused_moe import block as block_module
from engine.layers.fused_moe.weights import split_interleaved_gate_up
from engine.models.weights import PACKED_QKV_GATE_UP, load_weights
from kernels.moe_torch import fused_moe_torch

H, I, E = 32, 24, 8


def hf_config(model_type: str, **kw):
    base = dict(hidden_size=H, intermediate_size=I, moe_intermediate_size=I, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    base.update(kw)
    return transformers.AutoConfig.for_model(model_type, **base)


def randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in list(module.named_parameters()) + list(module.named_buffers()):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.3)


def per_expert_tensors(prefix: str, gate_up: torch.Tensor, down: torch.Tensor, names=("gate_proj", "up_proj",
                                                                                     "down_proj")):
    """What save_pretrained writes for HF's fused [E, 2I, H] / [E, H, I] expert parameters."""
    i = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        yield f"{prefix}.experts.{e}.{names[0]}.weight", gate_up[e, :i]
        yield f"{prefix}.experts.{e}.{names[1]}.weight", gate_up[e, i:]
        yield f"{prefix}.experts.{e}.{names[2]}.weight", down[e]


def load(ours: SparseMoeBlock, tensors) -> None:
    """Through the families' loader (engine/models/weights.py), with the block at `mlp`."""
    holder = torch.nn.Module()
    holder.mlp = ours
    load_weights(holder, tensors, packed_modules_mapping=PACKED_QKV_GATE_UP)


def qwen3(top_k=2, norm=True):
    cfg = hf_config("qwen3_moe", num_experts=E, num_experts_per_tok=top_k, norm_topk_prob=norm)
    hf = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    randomize(hf, 1)
    ours = SparseMoeBlock(RouterSpec(E, top_k, renormalize=norm), H, I, prefix="mlp")
    tensors = [("mlp.gate.weight", hf.gate.weight.data)]
    return hf, ours, tensors + list(per_expert_tensors("mlp", hf.experts.gate_up_proj.data, hf.experts.down_proj.data))


def mixtral(top_k=2):
    cfg = hf_config("mixtral", num_local_experts=E, num_experts_per_tok=top_k)
    hf = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
    randomize(hf, 2)
    ours = SparseMoeBlock(RouterSpec(E, top_k, renormalize=True), H, I, prefix="block_sparse_moe")
    tensors = [("mlp.gate.weight", hf.gate.weight.data)]
    return hf, ours, tensors + list(per_expert_tensors("mlp", hf.experts.gate_up_proj.data, hf.experts.down_proj.data,
                                                       ("w1", "w3", "w2")))


def gpt_oss(top_k=2):
    cfg = hf_config("gpt_oss", num_local_experts=E, num_experts_per_tok=top_k, head_dim=8)
    hf = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(cfg)
    randomize(hf, 3)
    with torch.no_grad():  # large enough pre-activations that the +-7 clamp is exercised
        hf.experts.gate_up_proj.mul_(8.0)
    ours = SparseMoeBlock(RouterSpec(E, top_k, softmax_after_topk=True), H, I, activation="swigluoai",
                          expert_bias=True, router_bias=True, prefix="mlp")
    x = hf.experts
    gate, up = split_interleaved_gate_up(x.gate_up_proj.data)
    gate_b, up_b = split_interleaved_gate_up(x.gate_up_proj_bias.data)
    tensors = [("mlp.gate.weight", hf.router.weight.data), ("mlp.gate.bias", hf.router.bias.data),
               ("mlp.experts.gate_proj.weight", gate), ("mlp.experts.up_proj.weight", up),
               ("mlp.experts.gate_proj.bias", gate_b), ("mlp.experts.up_proj.bias", up_b),
               ("mlp.experts.down_proj.weight", x.down_proj.data.transpose(1, 2)),
               ("mlp.experts.down_proj.bias", x.down_proj_bias.data)]  # stacked over all experts
    return hf, ours, tensors


def glm4_moe(top_k=2, groups=1, topk_groups=1):
    cfg = hf_config("glm4_moe", n_routed_experts=E, num_experts_per_tok=top_k, n_shared_experts=1,
                    n_group=groups, topk_group=topk_groups, routed_scaling_factor=2.5, norm_topk_prob=True)
    hf = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeMoE(cfg)
    randomize(hf, 4)
    ours = SparseMoeBlock(RouterSpec(E, top_k, scoring="sigmoid", renormalize=True, num_groups=groups,
                                     topk_groups=topk_groups, routed_scaling_factor=2.5), H, I,
                          correction_bias=True, router_fp32=True, shared_intermediate_size=I, prefix="mlp")
    tensors = [("mlp.gate.weight", hf.gate.weight.data),
               ("mlp.gate.e_score_correction_bias", hf.gate.e_score_correction_bias.data)]
    tensors += [(f"mlp.shared_experts.{n}.weight", getattr(hf.shared_experts, n).weight.data)
                for n in ("gate_proj", "up_proj", "down_proj")]
    return hf, ours, tensors + list(per_expert_tensors("mlp", hf.experts.gate_up_proj.data, hf.experts.down_proj.data))


FAMILIES = {"qwen3_moe": qwen3, "qwen3_moe-k1-nonorm": lambda: qwen3(1, False), "qwen3_moe-k8": lambda: qwen3(8),
            "mixtral": mixtral, "gpt_oss": gpt_oss, "glm4_moe": glm4_moe,
            "glm4_moe-groups": lambda: glm4_moe(2, 4, 2)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tokens", [1, 7])
def test_block_matches_hf(family, tokens):
    hf, ours, tensors = FAMILIES[family]()
    load(ours, tensors)
    x = torch.randn(1, tokens, H, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        expected = hf(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = ours(x[0])
    torch.testing.assert_close(got, expected.reshape(tokens, H), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "glm4_moe"])
def test_tensor_parallel_partial_sums_equal_one_rank(family, monkeypatch):
    """Each rank keeps half of every expert's intermediate dim (and of the shared experts'); the sum of the
    ranks' outputs (what the block's one all-reduce computes) equals the unsplit block."""
    monkeypatch.setattr(block_module, "all_reduce", lambda t: t)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(0))
    hf, full, tensors = FAMILIES[family]()
    load(full, tensors)
    partial = []
    try:
        for rank in range(2):
            init_tensor_parallel(rank, 2)
            _, ours, tensors = FAMILIES[family]()
            load(ours, tensors)
            assert ours.experts.w13_weight.shape == (E, I, H)
            partial.append(ours(x))
    finally:
        init_tensor_parallel(0, 1)
    torch.testing.assert_close(partial[0] + partial[1], full(x), atol=2e-5, rtol=1e-5)


def test_uneven_split_names_the_shape():
    try:
        init_tensor_parallel(0, 5)
        with pytest.raises(ValueError, match=r"model.layers.3.mlp.experts.*\(24, moe_intermediate_size\).*"
                                             r"tensor_parallel_size \(5\)"):
            SparseMoeBlock(RouterSpec(E, 2), H, I, prefix="model.layers.3.mlp")
    finally:
        init_tensor_parallel(0, 1)


def test_missing_and_repeated_expert_tensors_are_named():
    _, ours, tensors = qwen3()
    with pytest.raises(ValueError, match=r"missing 1 weight.*mlp.experts.w13_weight \[shard expert 5 w3\]"):
        load(ours, [t for t in tensors if t[0] != "mlp.experts.5.up_proj.weight"])
    _, ours, tensors = qwen3()
    with pytest.raises(ValueError, match=r"mlp.experts.2.down_proj.weight.*expert 2 w2.*second time"):
        load(ours, tensors + [t for t in tensors if t[0] == "mlp.experts.2.down_proj.weight"])


def test_wrong_expert_shape_is_an_error():
    _, ours, _ = qwen3()
    p = ours.experts.w13_weight
    with pytest.raises(ValueError, match=r"mlp.experts.*shape \(24, 31\)"):
        p.weight_loader(p, torch.zeros(I, H - 1), "w1", 0)
    with pytest.raises(ValueError, match="expert 8 is out of range"):
        p.weight_loader(p, torch.zeros(I, H), "w1", 8)


def test_router_spec_rejects_bad_configs():
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\)"):
        RouterSpec(8, 9)
    with pytest.raises(ValueError, match="n_group=3"):
        RouterSpec(8, 2, num_groups=3)


def test_reference_skips_experts_without_tokens():
    """Only the routed experts' weights are read: poisoning the others changes nothing."""
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    x = torch.randn(3, H, generator=gen)
    weights, ids = select_experts(torch.randn(3, E, generator=gen), RouterSpec(E, 2, renormalize=True))
    expected = fused_moe_torch(x, w13, w2, weights, ids)
    unused = sorted(set(range(E)) - set(ids.flatten().tolist()))
    w13[unused], w2[unused] = float("nan"), float("nan")
    torch.testing.assert_close(fused_moe_torch(x, w13, w2, weights, ids), expected)
