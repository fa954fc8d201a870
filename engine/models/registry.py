"""The model registry: each Hugging Face architecture name -> the family module and class that implement it.

The name table is plain data and this module imports nothing of torch, so `engine.config.model` (and through it
the GUI's planner) can say which architectures exist without loading any model code; `model_class` imports a
family module only when an engine actually builds that model. A new family is one file in engine/models/ and
one line here; a family whose checkpoints carry a multi-token-prediction head names the head's class in
`mtp_head` (speculative method "mtp": the engine loads it, the planner counts it). `text_defaults` are the
family's config defaults for fields a published config.json may leave out (HF fills them from its config
class; we do not import transformers to read a config).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Architecture:
    module: str  # engine.models.<module>
    class_name: str
    text_defaults: dict[str, Any] = field(default_factory=dict)  # applied under the (text) config's own values
    multimodal: bool = False  # a vision-language checkpoint served as text: its text model is under text_config
    norms_per_layer: int = 2  # hidden-size RMSNorms per decoder layer (the planner counts their weights)
    attn_output_gate: bool = False  # q_proj gives [query | gate] per head (Qwen3.5, Qwen3-Next)
    mtp_head: str | None = None  # "<module>:<class>" in engine/models/ of the MTP head its checkpoints carry
    o_proj_bias: bool = False  # `attention_bias` puts a bias on o_proj too, not only on q/k/v (HF's class does)


# transformers' Gemma3TextConfig defaults: published Gemma 3 configs leave most of these out.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "bos_token_id": 2, "eos_token_id": 1, "model_type": "gemma3_text",
    "qk_norm": True}  # not an HF key: Gemma 3 always has q/k norms
# transformers' Gemma2Config defaults (published Gemma 2 configs have no layer_types: even layers slide).
GEMMA2_DEFAULTS = {
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 2, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "model_type": "gemma2"}
# transformers' Gemma4TextConfig defaults (and its __post_init__'s: global layers' head_dim 512, their RoPE).
GEMMA4_TEXT_DEFAULTS = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "sliding_window": 512, "sliding_window_pattern": 6, "bos_token_id": 2, "eos_token_id": 1,
    "model_type": "gemma4_text", "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False, "num_kv_shared_layers": 0, "use_double_wide_mlp": False, "global_head_dim": 512,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0}},
    "qk_norm": True}  # not an HF key: Gemma 4 always has q/k norms
# transformers' MistralConfig defaults, under a Mistral3 checkpoint's text_config.
MISTRAL_TEXT_DEFAULTS = {
    "vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 14_336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "model_type": "mistral"}

# A vision-language checkpoint's text model, in both spellings: hub files and transformers 5 on disk
# (language_model.model.*) and transformers 5 in memory (model.language_model.*) -> our model.* names. The
# weights mapper renames tensors with these, ModelConfig the quantization ignore list.
VL_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                    ("model.language_model.", "model."))
# transformers' Qwen3NextConfig / Qwen3_5(Moe)TextConfig defaults for keys a published config may leave out; the
# q/k norms and the output gate are always there in these families.
QWEN3_NEXT_DEFAULTS = {
    "head_dim": 256, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "num_experts_per_tok": 10, "num_experts": 512, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "rms_norm_eps": 1e-6, "qk_norm": True}
QWEN3_5_DEFAULTS = {
    "vocab_size": 248_320, "head_dim": 256, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "rms_norm_eps": 1e-6, "qk_norm": True}
QWEN3_5_MOE_DEFAULTS = {**QWEN3_5_DEFAULTS, "num_experts_per_tok": 8, "num_experts": 256, "intermediate_size": 0,
                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}

QWEN3_NEXT_MTP = "qwen3_next_mtp:Qwen3NextMTP"  # Qwen3-Next's and Qwen3.5/3.6's head: mtp.* beside the model

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "LlamaForCausalLM", o_proj_bias=True),
    "Qwen2ForCausalLM": Architecture("llama", "LlamaForCausalLM", {"attention_bias": True}),
    "Qwen3ForCausalLM": Architecture("llama", "LlamaForCausalLM", {"qk_norm": True}, o_proj_bias=True),
    "MistralForCausalLM": Architecture("llama", "LlamaForCausalLM"),
    # Bare decoders, as embedding checkpoints save them (gte-Qwen2, e5-mistral): served with --task embed.
    "LlamaModel": Architecture("llama", "LlamaForCausalLM", o_proj_bias=True),
    "MistralModel": Architecture("llama", "LlamaForCausalLM"),
    "Qwen2Model": Architecture("llama", "LlamaForCausalLM", {"attention_bias": True}),
    "Qwen3Model": Architecture("llama", "LlamaForCausalLM", {"qk_norm": True}, o_proj_bias=True),
    "Phi3ForCausalLM": Architecture("phi3", "Phi3ForCausalLM"),
    "SmolLM3ForCausalLM": Architecture("smollm3", "SmolLM3ForCausalLM",
                                       {"rope_theta": 2e6, "tie_word_embeddings": True}, o_proj_bias=True),
    "Gemma3ForCausalLM": Architecture("gemma3", "Gemma3ForCausalLM", GEMMA3_TEXT_DEFAULTS, norms_per_layer=4,
                                      o_proj_bias=True),
    "Gemma3ForConditionalGeneration": Architecture("gemma3", "Gemma3ForConditionalGeneration", GEMMA3_TEXT_DEFAULTS,
                                                   multimodal=True, norms_per_layer=4, o_proj_bias=True),
    "Gemma4ForCausalLM": Architecture("gemma4", "Gemma4ForCausalLM", GEMMA4_TEXT_DEFAULTS, norms_per_layer=4,
                                      o_proj_bias=True),
    "Gemma4ForConditionalGeneration": Architecture("gemma4", "Gemma4ForConditionalGeneration", GEMMA4_TEXT_DEFAULTS,
                                                   multimodal=True, norms_per_layer=4, o_proj_bias=True),
    "Mistral3ForConditionalGeneration": Architecture("llama", "Mistral3ForConditionalGeneration",
                                                     MISTRAL_TEXT_DEFAULTS, multimodal=True),
    "Gemma2ForCausalLM": Architecture("gemma2", "Gemma2ForCausalLM", GEMMA2_DEFAULTS, norms_per_layer=4,
                                      o_proj_bias=True),
    "Qwen3VLForConditionalGeneration": Architecture("qwen3_vl", "Qwen3VLForConditionalGeneration", {"qk_norm": True},
                                                    multimodal=True, o_proj_bias=True),
    "Qwen3VLMoeForConditionalGeneration": Architecture("qwen3_vl", "Qwen3VLMoeForConditionalGeneration",
                                                       {"qk_norm": True}, multimodal=True, o_proj_bias=True),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "Qwen3MoeForCausalLM", {"qk_norm": True}, o_proj_bias=True),
    "MixtralForCausalLM": Architecture("qwen3_moe", "MixtralForCausalLM"),
    "Glm4MoeForCausalLM": Architecture("glm4_moe", "Glm4MoeForCausalLM", {"partial_rotary_factor": 0.5}),
    "GptOssForCausalLM": Architecture("gpt_oss", "GptOssForCausalLM", {"attention_bias": True}, o_proj_bias=True),
    # Hybrid linear attention: Gated DeltaNet layers with a per-sequence state, every fourth layer full attention.
    "Qwen3NextForCausalLM": Architecture("qwen3_next", "Qwen3NextForCausalLM", QWEN3_NEXT_DEFAULTS,
                                         attn_output_gate=True, mtp_head=QWEN3_NEXT_MTP, o_proj_bias=True),
    "Qwen3_5ForCausalLM": Architecture("qwen3_5", "Qwen3_5ForCausalLM", QWEN3_5_DEFAULTS, attn_output_gate=True,
                                       mtp_head=QWEN3_NEXT_MTP, o_proj_bias=True),
    "Qwen3_5ForConditionalGeneration": Architecture("qwen3_5", "Qwen3_5ForConditionalGeneration", QWEN3_5_DEFAULTS,
                                                    multimodal=True, attn_output_gate=True, mtp_head=QWEN3_NEXT_MTP,
                                                    o_proj_bias=True),
    "Qwen3_5MoeForCausalLM": Architecture("qwen3_5", "Qwen3_5MoeForCausalLM", QWEN3_5_MOE_DEFAULTS,
                                          attn_output_gate=True, mtp_head=QWEN3_NEXT_MTP, o_proj_bias=True),
    "Qwen3_5MoeForConditionalGeneration": Architecture("qwen3_5", "Qwen3_5MoeForConditionalGeneration",
                                                       QWEN3_5_MOE_DEFAULTS, multimodal=True, attn_output_gate=True,
                                                       mtp_head=QWEN3_NEXT_MTP, o_proj_bias=True),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# llama.cpp's `general.architecture` of a GGUF file -> the architecture above that serves it (each family file
# declares its GGUF tensor names beside its packed-module mapping). Mistral's GGUFs say "llama", Mistral-Small-3.x's
# text model (converted from Mistral3ForConditionalGeneration) "mistral3": a Llama block either way.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "gpt-oss": "GptOssForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM", "qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
}


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"model architecture {name!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return ARCHITECTURES[name]


def model_class(name: str) -> type:
    """The nn.Module class for architecture `name`, importing its family module now (torch comes with it)."""
    arch = get_architecture(name)
    return _import_class(arch.module, arch.class_name)


def mtp_head(name: str) -> str:
    """The "<module>:<class>" of architecture `name`'s MTP head; a ValueError naming speculative_config.method when
    the family declares none (the engine's check and the planner's ask the same question here)."""
    head = get_architecture(name).mtp_head
    if head is None:
        with_head = sorted(n for n, arch in ARCHITECTURES.items() if arch.mtp_head is not None)
        raise ValueError(f"speculative_config.method \"mtp\": {name} has no multi-token-prediction head this "
                         f"engine can run (built for {', '.join(with_head)})")
    return head


def mtp_head_class(name: str) -> type:
    """The nn.Module class of architecture `name`'s MTP head, importing its module now."""
    return _import_class(*mtp_head(name).split(":"))


def _import_class(module: str, class_name: str) -> type:
    return getattr(importlib.import_module(f"engine.models.{module}"), class_name)
