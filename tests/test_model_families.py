"""The families beyond Llama (Phi-3, Gemma 3 text and VL, Mistral3 VL): greedy ids identical to HF with chunk
boundaries inside the sliding window, prefix caching and forced preemption (plain runs are in test_engine_parity,
TP=2 in test_tensor_parallel); what their configs become; and the planner counting exactly what is loaded."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.worker.loader import iterate_weights
from engine.config.model import ModelConfig
from engine.models.registry import model_class
from engine.planning.weights import weights_bytes_per_card
from hf_reference import MAX_TOKENS, engine_greedy, hf_greedy
from test_scheduler_features import assert_pool_empty, prefix_prompts

NEW_FAMILIES = ["phi3", "gemma3", "gemma3-vl", "mistral3-vl"]


@pytest.mark.parametrize("arch,budget", [("gemma3", 5), ("gemma3-vl", 11), ("phi3", 7)])
def test_chunked_prefill_with_boundaries_inside_the_window_matches_hf(reference, arch, budget):
    """Window 8 (Gemma 3): chunks of 5 or 11 tokens end inside it, so a chunk's queries see keys of the last one."""
    path, prompts, expected = reference(arch)
    assert engine_greedy(path, prompts, MAX_TOKENS, max_num_batched_tokens=budget) == expected


@pytest.mark.parametrize("arch", ["gemma3-vl", "phi3"])
def test_forced_preemption_matches_hf(reference, arch):
    path, prompts, expected = reference(arch)
    # a block id is one page of every KV cache group (3 here: full + two window groups); chunks of 32 let the
    # window groups free behind the window, so the 230-token prompt needs about 23 ids: 26 hold it, not all 8
    llm = LLM(str(path), device="cpu", num_gpu_blocks_override=26, max_num_seqs=8, max_num_batched_tokens=32)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_empty(llm)


@pytest.mark.parametrize("arch", ["gemma3", "mistral3-vl"])
def test_prefix_caching_matches_hf_and_hits(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    prompts = prefix_prompts()
    expected = hf_greedy(path, prompts, [10] * len(prompts))
    llm = LLM(str(path), device="cpu")
    params = [SamplingParams(temperature=0, max_tokens=10)]
    for prompt, want in zip(prompts, expected):  # one at a time: earlier prompts are cached for later ones
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert llm.engine.kv.prefix_hits >= 64
    assert_pool_empty(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", *NEW_FAMILIES])
def test_planner_counts_exactly_what_is_loaded(tiny_model_dir, arch):
    """The planner's weights arithmetic equals the loaded parameters' bytes; a VL folder's vision tower and
    projector are in the checkpoint but never loaded, and never counted."""
    path = tiny_model_dir(arch)
    cfg = ModelConfig.from_folder(path)
    model = model_class(cfg.architecture)(cfg)
    model.load_weights(iterate_weights(path))
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights_bytes_per_card(cfg, 4) == loaded
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        vision = [k for k in f.keys() if k.startswith(("vision_tower.", "multi_modal_projector."))]
    assert bool(vision) == arch.endswith("-vl")
    assert not any("vision" in name or "projector" in name for name, _ in model.named_parameters())


def test_gemma3_layers_read_as_hf_builds_them(tiny_model_dir):
    from tiny_models import hf_model
    path = tiny_model_dir("gemma3-vl")
    cfg = ModelConfig.from_folder(path)
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.model_type == "gemma3_text"
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert cfg.sliding_windows == [8, 8, None] and cfg.tie_word_embeddings and cfg.norms_per_layer == 4
    model = model_class(cfg.architecture)(cfg)
    layers = model.model.layers
    assert layers[0].self_attn.rotary_emb is layers[1].self_attn.rotary_emb
    assert layers[0].self_attn.rotary_emb is not layers[2].self_attn.rotary_emb
    hf = hf_model(path).model.language_model
    for ours, theirs in zip(layers, hf.layers):
        assert ours.self_attn.attn.scale == theirs.self_attn.scaling == 24 ** -0.5
        assert ours.self_attn.attn.sliding_window == theirs.self_attn.sliding_window
    assert model.lm_head.weight is model.model.embed_tokens.weight


# Published config.json of google/gemma-3-27b-it (the keys it has; transformers' defaults fill in the rest).
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "text_config": {
        "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
        "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                      "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_published_gemma3_27b_config_reads_as_transformers_does():
    from transformers import AutoConfig
    cfg = ModelConfig.from_hf_config(GEMMA3_27B)
    hf = AutoConfig.for_model(**{k: v for k, v in GEMMA3_27B.items() if k != "architectures"}).text_config
    assert cfg.layer_types == hf.layer_types and cfg.layer_types.count("full_attention") == 10
    assert cfg.sliding_windows == [1024 if t == "sliding_attention" else None for t in hf.layer_types]
    assert cfg.vocab_size == hf.vocab_size == 262_208 and cfg.max_position_embeddings == 131_072
    assert cfg.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert cfg.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    for layer_type, params in hf.rope_parameters.items():
        assert cfg.rope_parameters[layer_type]["rope_theta"] == params["rope_theta"]
    assert cfg.hf_text_config["query_pre_attn_scalar"] == 168 and cfg.head_dim == 128
    assert cfg.eos_token_ids == [1, 106] and cfg.torch_dtype == "bfloat16" and cfg.tie_word_embeddings


@pytest.mark.parametrize("field,value,message", [
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_act", "silu", "hidden_activation 'silu' is not supported")])
def test_gemma3_refuses_what_it_does_not_implement(tiny_model_dir, field, value, message):
    """(Attention soft-capping is implemented: Gemma 2 runs on this decoder, tests/test_family_gemma2.py.)"""
    cfg = ModelConfig.from_folder(tiny_model_dir("gemma3"))
    if field == "hidden_act":
        cfg.hidden_act = value
    else:
        cfg.hf_text_config = {**cfg.hf_text_config, field: value}
    with pytest.raises(ValueError, match=message):
        model_class(cfg.architecture)(cfg)


def test_smollm3_nope_layer_attends_without_rotary_and_matches_hf_in_chunks(reference, tiny_model_dir):
    """SmolLM3 (the Llama block, rotary off where no_rope_layers says 0, o_proj biased with attention_bias): the
    layer is built so, and greedy ids equal HF's with prompt chunks of 7 tokens (plain runs: test_engine_parity,
    TP=2: test_tensor_parallel)."""
    path, prompts, expected = reference("smollm3")
    cfg = ModelConfig.from_folder(path)
    model = model_class(cfg.architecture)(cfg)
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.rotary_emb is None for a in attention] == [False, True, False]
    assert all(a.o_proj.bias is not None for a in attention) and model.lm_head.weight is model.model.embed_tokens.weight
    assert engine_greedy(path, prompts, MAX_TOKENS, max_num_batched_tokens=7) == expected


def test_the_nope_layer_changes_hf_output(tiny_model_dir):
    """Guard: HF's output moves when its NoPE layer turns rotary on, so matching it means the engine turns it off."""
    from tiny_models import hf_model
    model = hf_model(tiny_model_dir("smollm3"))
    ids = torch.randint(5, 300, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        nope = model(ids).logits
        model.model.layers[1].self_attn.use_rope = 1
        roped = model(ids).logits
    assert float((nope - roped).abs().max()) > 0.05


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_bias_puts_a_bias_on_o_proj_where_hf_does(tiny_model_dir, arch):
    """HF's Llama and Qwen3 give o_proj a bias with `attention_bias` (Qwen2 and Mistral do not): the registry's
    o_proj_bias says which, the model loads the checkpoint's o_proj.bias, output is HF's and the planner counts it."""
    from hf_reference import hf_greedy, make_prompts
    path = tiny_model_dir(arch, attention_bias=True)
    cfg = ModelConfig.from_folder(path)
    assert cfg.qkv_bias and cfg.o_bias
    model = model_class(cfg.architecture)(cfg)
    model.load_weights(iterate_weights(path))  # every tensor, o_proj.bias included, accounted for
    assert weights_bytes_per_card(cfg, 4) == sum(p.numel() * p.element_size() for p in model.parameters())
    prompts = make_prompts(400)[:3]
    want = hf_greedy(path, prompts, [8, 8, 8])
    got = [o.outputs[0].token_ids for o in LLM(str(path), device="cpu").generate(
        prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]
    assert got == want
