"""Gemma 4 against HF transformers on the same tiny checkpoints: greedy ids identical with chunk boundaries
inside the 8-token window and under prefix caching with forced preemption (plain runs are in
test_engine_parity, TP=2 in test_tensor_parallel: both cover "gemma4" and "gemma4-vl"); the per-layer shapes,
KV sharing and page widening read as transformers builds them; proportional RoPE against transformers' own
init function; the planner counting exactly what is loaded; and what the family refuses.

"gemma4" is shaped as the E2B/E4B models are (per-layer inputs, the last two layers sharing KV, double-wide
MLPs there, wider global heads so the local layers' KV head is stored twice); "gemma4-vl" as the 31B is
(global layers with V = K and one 32-dim KV head, no per-layer inputs), built as Gemma4ForConditionalGeneration.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.kv.kv_cache_interface import kv_head_replicas, model_kv_layout
from engine.layers.rotary import rope_inv_freq
from engine.worker.loader import iterate_weights
from engine.config.model import ModelConfig
from engine.models.registry import model_class
from engine.planning.weights import weights_bytes_per_card
from hf_reference import MAX_TOKENS, engine_greedy, hf_greedy
from test_scheduler_features import assert_pool_empty
from tiny_models import hf_model

S, F = "sliding_attention", "full_attention"


def test_e2b_shaped_config_reads_as_transformers_builds_it(tiny_model_dir):
    path = tiny_model_dir("gemma4")
    cfg = ModelConfig.from_folder(path)
    hf = hf_model(path).config
    assert cfg.layer_types == hf.layer_types == [S, F, S, F]
    assert cfg.layer_head_dims == [hf.per_layer_config[i].head_dim for i in range(4)] == [16, 32, 16, 32]
    # kv_sharing_modes: layers 2 and 3 reuse the last earlier layer of their type
    assert hf.kv_sharing_modes == ["store", "store", "reuse", "reuse"] and cfg.kv_source_layers == [0, 1, 0, 1]
    assert cfg.cache_layers == [0, 1] and cfg.layer_intermediate_sizes == [128, 128, 256, 256]
    assert cfg.per_layer_input_size == 8 and cfg.sliding_windows == [8, None, 8, None]
    assert cfg.rope_parameters[F]["rope_type"] == "proportional"
    # local pages are 1 head x 16 dims, global ones 1 x 32: the local head is stored twice
    assert kv_head_replicas(cfg) == [2, 1, 2, 1]
    layout = model_kv_layout(cfg, 16)
    assert [g.layer_ids for g in layout.groups] == [(1,), (0,)] and layout.bytes_per_block == 2 * 16 * 32 * 2
    assert layout.group_names() == ["full attention · 1 layer", "window 8 · 1 layer"]


def test_hub_spelling_reads_as_transformers_does():
    """google/gemma-4-* config.json files say global_head_dim / num_global_key_value_heads, not per_layer_config."""
    from transformers import AutoConfig
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, head_dim=16, global_head_dim=64, num_global_key_value_heads=1,
                attention_k_eq_v=True, sliding_window=32, hidden_size_per_layer_input=0, vocab_size=256)
    hf = AutoConfig.for_model("gemma4_text", **text)
    cfg = ModelConfig.from_hf_config({"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", **text})
    assert cfg.layer_types == hf.layer_types == [S] * 5 + [F]
    assert cfg.layer_head_dims == [hf.per_layer_config[i].head_dim for i in range(6)]
    assert cfg.layer_num_kv_heads == [hf.per_layer_config[i].num_key_value_heads for i in range(6)] == [4] * 5 + [1]
    assert cfg.k_eq_v_layers == [False] * 5 + [True] and cfg.kv_source_layers == []
    assert cfg.rope_parameters == {F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                                   S: {"rope_type": "default", "rope_theta": 1e4}}
    assert kv_head_replicas(cfg) == [1] * 6  # 4 x 16 = 1 x 64: pages already equal
    with pytest.raises(ValueError, match=r"layer 5's KV page \(1 KV heads x 48 dims.* cannot be widened"):
        kv_head_replicas(ModelConfig.from_hf_config({"architectures": ["Gemma4ForCausalLM"], **text,
                                                     "global_head_dim": 48}))


def test_proportional_rope_matches_transformers():
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = AutoConfig.for_model("gemma4_text", num_hidden_layers=2, head_dim=16, global_head_dim=64,
                              layer_types=[S, F], rope_parameters={
                                  S: {"rope_type": "default", "rope_theta": 1e4},
                                  F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                      "rope_theta": 1e6, "factor": 2.0}})
    theirs, factor = ROPE_INIT_FUNCTIONS["proportional"](hf, "cpu", layer_type=F)
    ours, our_factor = rope_inv_freq(hf.rope_parameters[F], 64, 512)
    assert torch.equal(ours, theirs.float()) and our_factor == factor == 1.0
    assert int((ours != 0).sum()) == 8  # a quarter of the 32 frequencies turn; the rest pass through


def test_the_gemma4_features_change_hf_output(tiny_model_dir):
    """Guard: per-layer inputs and layer scalars matter here, so parity means the engine applies them."""
    model = hf_model(tiny_model_dir("gemma4"))
    ids = torch.randint(5, 300, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids).logits
        scalars = [layer.layer_scalar.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.layer_scalar.fill_(1.0)
        unscaled = model(ids).logits
        for layer, s in zip(model.model.layers, scalars):
            layer.layer_scalar.copy_(s)
        model.model.embed_tokens_per_layer.weight.zero_()
        no_own_inputs = model(ids).logits
    assert float((base - unscaled).abs().max()) > 0.05 and float((base - no_own_inputs).abs().max()) > 0.05


def test_chunked_prefill_with_boundaries_inside_the_window_matches_hf(reference):
    """5-token chunks: KV-sharing layers attend over a source cache the same step's chunk has just extended."""
    path, prompts, expected = reference("gemma4")
    assert engine_greedy(path, prompts, MAX_TOKENS, max_num_batched_tokens=5) == expected


def test_prefix_caching_and_forced_preemption_match_hf(tiny_model_dir):
    """KV-sharing layers read their source layers' cached blocks: prefix hits and recomputed prompts too."""
    path = tiny_model_dir("gemma4")
    shared = [(i * 7) % 300 + 5 for i in range(45)]  # longer than the window: hits cover windowed blocks
    prompts = [shared + [(i * 13 + j) % 300 + 5 for j in range(3 + 5 * i)] for i in range(5)]
    expected = hf_greedy(path, prompts, [24] * len(prompts))
    llm = LLM(str(path), device="cpu", num_gpu_blocks_override=18, block_size=8, max_num_seqs=5,
              max_num_batched_tokens=24)
    got = [o.outputs[0].token_ids for o in
           llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=24)] * 5, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert got == expected
    assert_pool_empty(llm)


@pytest.mark.parametrize("arch", ["gemma4", "gemma4-vl"])
def test_planner_counts_exactly_what_is_loaded(tiny_model_dir, arch):
    """Per-layer shapes, k_eq_v (no v_proj), KV-sharing layers (no k/v), per-layer inputs; a VL folder's vision
    tower and embedder are in the checkpoint but never loaded, never counted."""
    path = tiny_model_dir(arch)
    cfg = ModelConfig.from_folder(path)
    model = model_class(cfg.architecture)(cfg)
    model.load_weights(iterate_weights(path))
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights_bytes_per_card(cfg, 4) == loaded == cfg.num_params * 4
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert any("vision_tower." in k for k in f.keys()) == arch.endswith("-vl")
    assert not any("vision" in name for name, _ in model.named_parameters())


def test_shared_layers_kv_tensors_are_skipped_and_a_missing_query_is_named(tiny_model_dir):
    """Google's checkpoints keep k/v tensors on the KV-sharing layers, which compute none (HF skips them too)."""
    path = tiny_model_dir("gemma4")
    weights = dict(iterate_weights(path))
    extra = {**weights, "model.layers.3.self_attn.k_proj.weight": torch.zeros(32, 64),
             "model.layers.3.self_attn.k_norm.weight": torch.ones(32)}
    cfg = ModelConfig.from_folder(path)
    model_class(cfg.architecture)(cfg).load_weights(extra.items())
    del weights["model.layers.2.self_attn.q_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): model.layers.2.self_attn.qkv_proj.weight"):
        model_class(cfg.architecture)(cfg).load_weights(weights.items())


@pytest.mark.parametrize("field,value,message", [
    ("enable_moe_block", True, "enable_moe_block .* not supported yet"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention 'all'")])
def test_gemma4_refuses_what_it_does_not_implement(tiny_model_dir, field, value, message):
    cfg = ModelConfig.from_folder(tiny_model_dir("gemma4-vl"))
    cfg.hf_text_config = {**cfg.hf_text_config, field: value}
    with pytest.raises(ValueError, match=message):
        model_class(cfg.architecture)(cfg)
