"""ModelConfig: what the engine needs from a Hugging Face config.json, with per-architecture quirks resolved.

One decoder implementation serves every supported architecture; this module turns each family's
config into the switches that decoder reads (QKV bias, q/k RMSNorm, tied embeddings, explicit head_dim,
rope scaling, sliding window) and reads its quantization_config. Torch-free, so the GUI's capacity planner reads models the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.moe_config import MOE_ARCHITECTURES, MoEConfig, parse_moe_config
from engine.quantization.config import QuantConfig, parse_quantization_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           *MOE_ARCHITECTURES)
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_windows: list[int | None] = field(default_factory=list)  # per layer
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    max_model_len: int = 0
    quantization: QuantConfig | None = None  # from quantization_config; None for float checkpoints
    moe: MoEConfig | None = None  # the mixture-of-experts layers; None for dense models

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None,
                       quantization: str | None = None) -> "ModelConfig":
        """`quantization` (--quantization) may only name the method the folder's quantization_config has."""
        architecture = (hf.get("architectures") or ["<none>"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model architecture {architecture!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported yet (supported: default, llama3)")
        num_layers = hf["num_hidden_layers"]
        max_pos = hf.get("max_position_embeddings", 2048)
        return cls(
            architecture=architecture, hidden_size=hf["hidden_size"], num_layers=num_layers,
            num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
            max_position_embeddings=max_pos, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta), rope_scaling=rope if rope_type == "llama3" else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or bool(hf.get("use_qk_norm")),
            sliding_windows=_sliding_windows(hf, num_layers),
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf, generation or {}), max_model_len=max_pos,
            quantization=parse_quantization_config(hf, quantization), moe=parse_moe_config(hf, architecture))

    @classmethod
    def from_folder(cls, path: str | Path, quantization: str | None = None) -> "ModelConfig":
        path = Path(path)
        hf = json.loads((path / "config.json").read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.exists() else {}
        return cls.from_hf_config(hf, generation, quantization)

    def with_max_model_len(self, max_model_len: int | None) -> "ModelConfig":
        if max_model_len is not None and max_model_len > self.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} is longer than the model's context "
                             f"({self.max_position_embeddings} tokens, max_position_embeddings)")
        self.max_model_len = max_model_len or self.max_position_embeddings
        return self

    def mlp_params(self) -> tuple[int, int, int]:
        """(matrix params of every layer's MLP or experts, of what one token goes through, router/bias params)."""
        dense = 3 * self.hidden_size * self.intermediate_size
        if self.moe is None:
            return self.num_layers * dense, self.num_layers * dense, 0
        total, active, vectors = self.moe.layer_params(self.hidden_size)
        n_moe = len(self.moe.moe_layers)
        n_dense = self.num_layers - n_moe
        return n_moe * total + n_dense * dense, n_moe * active + n_dense * dense, n_moe * vectors

    def _params(self, active: bool) -> int:
        h, v = self.hidden_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        total_mlp, active_mlp, mlp_vectors = self.mlp_params()
        per_layer = h * (q + 2 * kv) + q * h + 2 * h
        return (self.num_layers * per_layer + (active_mlp if active else total_mlp) + mlp_vectors
                + v * h * (1 if self.tie_word_embeddings else 2) + h)

    @property
    def num_params(self) -> int:
        """Every weight the model holds: all experts of an MoE model."""
        return self._params(active=False)

    @property
    def num_active_params(self) -> int:
        """The weights one token goes through: the top_k routed experts (and shared experts) of each MoE layer."""
        return self._params(active=True)


def _sliding_windows(hf: dict[str, Any], num_layers: int) -> list[int | None]:
    window = hf.get("sliding_window")
    if window is None or hf.get("use_sliding_window") is False:
        return [None] * num_layers
    layer_types = hf.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * num_layers


def _eos_ids(hf: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), hf.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids
