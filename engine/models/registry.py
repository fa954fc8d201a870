"""The model registry: each Hugging Face architecture name -> the family module and class that implement it.

The name table is plain data and this module imports nothing of torch, so `engine.model_config` (and through it
the GUI's planner) can say which architectures exist without loading any model code; `model_class` imports a
family module only when an engine actually builds that model. A new family is one file in engine/models/ and
one line here. `text_defaults` are the family's config defaults for fields a published config.json may leave
out (HF fills them from its config class; we do not import transformers to read a config).
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


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": Architecture("llama", "LlamaForCausalLM", {"attention_bias": True}),
    "Qwen3ForCausalLM": Architecture("llama", "LlamaForCausalLM", {"qk_norm": True}),
    "MistralForCausalLM": Architecture("llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "Qwen3MoeForCausalLM", {"qk_norm": True}),
    "MixtralForCausalLM": Architecture("qwen3_moe", "MixtralForCausalLM"),
    "Glm4MoeForCausalLM": Architecture("glm4_moe", "Glm4MoeForCausalLM", {"partial_rotary_factor": 0.5}),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"model architecture {name!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return ARCHITECTURES[name]


def model_class(name: str) -> type:
    """The nn.Module class for architecture `name`, importing its family module now (torch comes with it)."""
    arch = get_architecture(name)
    return getattr(importlib.import_module(f"engine.models.{arch.module}"), arch.class_name)
