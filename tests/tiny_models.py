"""Tiny random-weight Hugging Face model folders for tests: config, safetensors, tokenizer, chat template.

`make_tiny_model(tmp_dir, arch)` writes a folder exactly like one from the hub (config.json,
model.safetensors or a sharded set with an index, tokenizer.json, tokenizer_config.json with a chat
template, generation_config.json), built from transformers configs with random weights, so the real
loading code runs and HF transformers on the same folder is the correctness reference.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "PagedAttention splits the KV cache into blocks.",
    "def main():\n    print('hello world')\n", "Continuous batching schedules at every step.",
    "Les élèves étudient l'été à Paris. Ça coûte cher!", "日本語のテキストも少しだけ。", "Emoji: 🚀🔥✨ 👍",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000", "Qwen, Llama and Mistral are model families.",
]
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# A Qwen2.5-style (hermes) template with tools, tool calls, tool results and reasoning, for the API tests.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n{%- for t in tools %}{{ t | tojson }}\n"
    "{%- endfor %}</tools>\nReply with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{% endif %}{%- for m in messages %}{%- if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "<|im_start|>assistant\n{%- for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

GEMMA3_TEXT = dict(
    num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, tie_word_embeddings=True,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
# Hybrid linear attention (Gated DeltaNet layers with a per-sequence state, alternating with gated full
# attention): 2 key heads expanding to 4 value heads, a 4-tap conv, partial rotary over 4 of 16 dims.
HYBRID = dict(head_dim=16, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, tie_word_embeddings=False)
HYBRID_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
HYBRID_ARCHS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(HYBRID, **HYBRID_MOE, mlp_only_layers=[2])),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(HYBRID)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(HYBRID, **HYBRID_MOE)),
}
HYBRID_VL_ARCHS = {  # a Qwen3.5 VL checkpoint served as text (kept out of VL_ARCHS: the dense suites iterate those)
    "qwen3_5-vl": ("qwen3_5", dict(HYBRID), dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, out_hidden_size=64,
        num_position_embeddings=16), dict(tie_word_embeddings=False)),
}
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=48, tie_word_embeddings=False)),
    # Fused qkv_proj/gate_up_proj tensors; LongRoPE (short factors: the context never passes the original one)
    # with Phi-4-mini's partial rotary (12 of 16 dims).
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        original_max_position_embeddings=512, partial_rotary_factor=0.75, tie_word_embeddings=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
                         "partial_rotary_factor": 0.75, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                         "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})),
    # A NoPE layer between two RoPE ones (no_rope_layers), biases on q/k/v and o; weights ten times HF's init, so
    # attention depends on positions (at HF's init it is nearly uniform and rotary on the NoPE layer would not show).
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        num_hidden_layers=3, no_rope_layers=[1, 0, 1], attention_bias=True, initializer_range=0.2,
        tie_word_embeddings=True)),
    # Alternating 20-token window / global layers (the window is not a multiple of the block size); weights
    # ten times HF's init so attention scores reach the soft cap's bend, caps small enough to matter.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=20, attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0, initializer_range=0.2, tie_word_embeddings=True)),
    # Two local layers (window 8: prompts run far past it) and one global, each with its own RoPE table; a
    # query_pre_attn_scalar that is not head_dim.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(GEMMA3_TEXT)),
    # Gemma 4 as E2B/E4B are built: per-layer inputs, the last two layers sharing the KV of layers 0 (local) and
    # 1 (global) with double-wide MLPs, global layers with 32-dim heads and proportional RoPE (local pages are
    # half as wide, so their KV head is stored twice), a final soft cap.
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, global_head_dim=32, num_key_value_heads=1, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input="vocab", num_kv_shared_layers=2, use_double_wide_mlp=True,
        final_logit_softcapping=10.0, tie_word_embeddings=True)),
}
GEMMA4_31B_TEXT = dict(  # as the 31B is built: global layers with V = K, one KV head of 32 dims; no per-layer inputs
    num_hidden_layers=3, head_dim=16, global_head_dim=32, num_key_value_heads=2, num_global_key_value_heads=1,
    attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=8, final_logit_softcapping=10.0,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], tie_word_embeddings=True)
# Vision-language checkpoints served as text: (model_type, text config, vision config), built with
# AutoModelForImageTextToText.from_config, so the folder holds a (tiny) vision tower and projector too.
VL_ARCHS = {
    "gemma3-vl": ("gemma3", dict(GEMMA3_TEXT), dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14), dict(mm_tokens_per_image=4)),
    "mistral3-vl": ("mistral3", dict(model_type="mistral", head_dim=16, sliding_window=None,
                                     tie_word_embeddings=False), dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14, head_dim=16), dict(spatial_merge_size=1, tie_word_embeddings=False)),
    "gemma4-vl": ("gemma4", dict(GEMMA4_31B_TEXT), dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16), dict()),
}
ARCHS.update({name: (None, None, None) for name in VL_ARCHS})

# Mixture-of-experts families: 8 experts, top-2 (kept out of ARCHS so the dense parity suites stay as they are).
MOE_ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, sliding_window=None,
        tie_word_embeddings=False)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
        partial_rotary_factor=0.5, attention_bias=True, tie_word_embeddings=False)),
    # Alternating 8-token window / global layers with sinks, YaRN, biases everywhere, clamped SwiGLU experts.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
        tie_word_embeddings=False)),
}
ROUTER_WEIGHTS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")


@functools.cache
def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   chat_template=CHAT_TEMPLATE)


def make_tiny_model(tmp_dir: str | Path, arch: str = "llama", shards: int = 1, seed: int = 0,
                    chat_template: str | None = None, added_tokens: tuple[str, ...] = (), **overrides) -> Path:
    """Write a random-weight `arch` model folder under tmp_dir and return its path (`chat_template`
    replaces the default one; `added_tokens` join the vocabulary as plain, non-special tokens)."""
    import transformers
    from transformers import GenerationConfig

    vl_archs = {**VL_ARCHS, **HYBRID_VL_ARCHS}
    config_name, model_name, extra = (ARCHS.get(arch) or MOE_ARCHS.get(arch) or HYBRID_ARCHS.get(arch)
                                      or (None, None, None))
    if arch in vl_archs:
        extra = vl_archs[arch][1]
    tokenizer = _tokenizer()
    if chat_template is not None or added_tokens:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = chat_template or tokenizer.chat_template
        tokenizer.add_tokens(list(added_tokens))
    vocab = len(tokenizer)
    kwargs = dict(vocab_size=vocab + 12, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6, torch_dtype="float32")
    kwargs.update(extra)
    kwargs.update(overrides)
    if kwargs.get("vocab_size_per_layer_input") == "vocab":  # Gemma 4's per-layer inputs cover every token
        kwargs["vocab_size_per_layer_input"] = kwargs["vocab_size"]
    torch.manual_seed(seed)
    if arch in vl_archs:
        model_type, _, vision, top = vl_archs[arch]
        config = transformers.AutoConfig.for_model(model_type, text_config=kwargs, vision_config=vision, **top)
        model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    else:
        config = getattr(transformers, config_name)(**kwargs)
        config.architectures = [model_name]
        model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # HF init leaves biases zero and norms one; randomize them so they matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(ROUTER_WEIGHTS):  # decisive routing: no near-ties between experts
                p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():  # GLM's score-correction bias moves the choice: make it matter
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
            elif name.endswith("layer_scalar"):  # Gemma 4 scales each layer's output by a learned scalar
                b.copy_(1 + torch.randn_like(b) * 0.2)
    if arch in vl_archs:  # the text model's ids are what generation_config and the tokenizer speak
        config.text_config.bos_token_id, config.text_config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    path = Path(tmp_dir) / f"tiny-{arch}"
    max_shard = "40KB" if shards > 1 else "2GB"
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard)
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return path


SCRIPTED_REPLY = ("Hello", " from", " PagedDesk.")  # each piece one added token (make_scripted_model)
WEATHER_CALL_REPLY = ("<tool_call>", '{"name": "get_weather", "arguments": {"location": "San Francisco, CA"}}',
                      "</tool_call>")  # a hermes tool call when tools are given, plain text otherwise


def make_scripted_model(tmp_dir: str | Path, reply: tuple[str, ...], chat_template: str = TOOL_CHAT_TEMPLATE,
                        **overrides) -> Path:
    """A tiny qwen2 that answers every chat turn with `reply` and then its EOS token, sampled or greedy: for tests
    of whole clients (agent CLIs, compliance suites) that need an answer that ends.

    Every layer writes nothing (o_proj and down_proj are zero), so the next token depends on the current one
    only; each reply piece is one added token, and the embeddings and LM head chain the generation prompt's last
    token to the first piece, each piece to the next, the last to EOS (logit margin ~16). The rest of the
    weights stay random, so every kernel still runs on real numbers."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_dir, "qwen2", chat_template=chat_template, added_tokens=reply,
                           tie_word_embeddings=False, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(path)
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = probe["input_ids"] if isinstance(probe, dict) or hasattr(probe, "keys") else probe
    chain = [ids[-1]] + [tokenizer.convert_tokens_to_ids(piece) for piece in reply] + [tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), f"the reply's tokens must differ from each other: {chain}"
    weights = load_file(path / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    directions = torch.linalg.qr(torch.randn(hidden, len(chain) - 1, generator=torch.Generator().manual_seed(0)))[0]
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
    weights["model.norm.weight"].fill_(1.0)
    for k, (token, following) in enumerate(zip(chain, chain[1:])):
        weights["model.embed_tokens.weight"][token] = directions[:, k]
        weights["lm_head.weight"][following] = 2.0 * directions[:, k]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def hf_model(path: str | Path):
    """The transformers reference model for a folder, float32 on CPU (a VL folder: its image-text-to-text model,
    which generates from text alone)."""
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    vl = "text_config" in json.loads((Path(path) / "config.json").read_text())
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()

