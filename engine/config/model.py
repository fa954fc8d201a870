"""ModelConfig: what the engine needs from a Hugging Face config.json, with per-architecture quirks resolved.

The registry (engine/models/registry.py) says which family serves the architecture; this module reads the
text model's config — `text_config` merged over the top level for vision-language checkpoints served as
text, the family's defaults under both — into plain fields: shapes, a per-layer `layer_types` list
("full_attention", "sliding_attention", or "linear_attention" for a hybrid model's Gated DeltaNet layers,
described by `linear_attention`) with the matching `sliding_windows`, RoPE parameters per attention layer
type, and the quantization_config. The merged dict stays in `hf_text_config` for the few switches only one family
reads. Torch-free, so the GUI's capacity planner reads models the same way.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.gguf_config import gguf_hf_config
from engine.config.gguf_file import is_gguf, read_gguf_header
from engine.models.registry import SUPPORTED_ARCHITECTURES, VL_TEXT_PREFIXES, get_architecture
from engine.config.moe import MoEConfig, parse_moe_config
from engine.config.pooler import PoolerConfig
from engine.config.vision import VisionConfig, parse_vision_config
from engine.quantization.config import QuantConfig, parse_quantization_config

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "DTYPE_BYTES", "ROPE_TYPES", "LAYER_TYPES"]

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")  # engine/layers/rotary.py builds them
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
ATTENTION_TYPES = ("full_attention", "sliding_attention")  # the layer types with a KV cache and RoPE
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "vision_tower_config")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """A hybrid model's Gated DeltaNet layers (Qwen3-Next, Qwen3.5): heads, the short conv, the state dtype."""

    layers: tuple[int, ...]  # the model layers of type linear_attention
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    ssm_dtype_bytes: int = 4  # mamba_ssm_dtype: the recurrent state stays float32 under bf16 weights
    # llama.cpp's qwen35 GGUFs: out_proj's input columns hold the value heads "tiled" (head j of every key head,
    # then j + 1), not grouped by key head; its blocks can span heads, so the layer reorders its output instead
    out_proj_tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv and its state: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def matrix_params(self, hidden_size: int) -> int:
        """One layer's projections: q/k/v/z in, b/a in, out."""
        return hidden_size * (self.conv_dim + self.value_dim + 2 * self.num_v_heads) + self.value_dim * hidden_size

    def vector_params(self) -> int:
        """One layer's conv weights, A_log, dt_bias and the gated norm's weight."""
        return self.conv_dim * self.conv_kernel + 2 * self.num_v_heads + self.head_v_dim


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
    rope_theta: float = 10000.0  # the full-attention layers' base (rope_parameters["full_attention"])
    rope_scaling: dict[str, Any] | None = None  # the full-attention layers' scaling, with its rope_type; None: plain
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # o_proj's bias: attention_bias where the family's o_proj takes it (the registry says)
    qk_norm: bool = False
    sliding_windows: list[int | None] = field(default_factory=list)  # per layer
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    max_model_len: int = 0
    quantization: QuantConfig | None = None  # from quantization_config; None for float checkpoints
    model_type: str = ""  # the text model's model_type (gemma3_text under a gemma3 checkpoint)
    layer_types: list[str] = field(default_factory=list)  # per layer, one of LAYER_TYPES
    # Per layer type present: {"rope_type", "rope_theta", and that type's own keys}; "full_attention" always.
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0  # the share of head_dim that is rotated
    hidden_act: str = "silu"
    norms_per_layer: int = 2  # hidden-size RMSNorms per layer (Gemma 3: four)
    hf_text_config: dict[str, Any] = field(default_factory=dict, repr=False)  # merged text config, as read
    moe: MoEConfig | None = None  # the mixture-of-experts layers; None for dense models
    # Per layer, where layers differ (Gemma 4: wider heads, fewer KV heads on global layers); empty: all equal
    # to head_dim / num_kv_heads / intermediate_size. Read them through the layer_* methods.
    layer_head_dims: list[int] = field(default_factory=list)
    layer_num_kv_heads: list[int] = field(default_factory=list)
    layer_intermediate_sizes: list[int] = field(default_factory=list)
    # Per layer, the layer whose KV cache it attends over: itself, or an earlier layer of its type (Gemma 4's
    # KV sharing: the last layers compute only queries). Empty: every layer its own.
    kv_source_layers: list[int] = field(default_factory=list)
    k_eq_v_layers: list[bool] = field(default_factory=list)  # Gemma 4's attention_k_eq_v: V is K's projection
    per_layer_input_size: int = 0  # Gemma 4's per-layer input embeddings (hidden_size_per_layer_input); 0: none
    linear_attention: LinearAttentionConfig | None = None  # hybrid models' Gated DeltaNet layers
    attn_output_gate: bool = False  # Qwen3.5/Qwen3-Next: q_proj also gives a per-head output gate
    pooler: PoolerConfig | None = None  # set for an embedding engine (--task embed): pooled, no LM head
    vision: VisionConfig | None = None  # a vision-language checkpoint's image side (engine/config/vision.py)

    @property
    def attention_layer_ids(self) -> list[int]:
        """The layers with a KV cache (all of them, but for a hybrid model's linear-attention layers)."""
        return [i for i, t in enumerate(self.layer_types or ["full_attention"] * self.num_layers)
                if t != "linear_attention"]

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None,
                       quantization: str | None = None) -> "ModelConfig":
        """`quantization` (--quantization) may only name the method the folder's quantization_config has."""
        architecture = (hf.get("architectures") or ["<none>"])[0]
        arch = get_architecture(architecture)
        text = text_config(hf, arch.text_defaults)
        num_heads = text["num_attention_heads"]
        num_layers = text["num_hidden_layers"]
        max_pos = text.get("max_position_embeddings", 2048)
        head_dim = text.get("head_dim") or text["hidden_size"] // num_heads
        layer_types = _layer_types(text, num_layers)
        rope = _rope_parameters(text, layer_types)
        full = rope["full_attention"]
        window = text.get("sliding_window")
        num_kv_heads = text.get("num_key_value_heads") or num_heads
        per_layer = _per_layer_overrides(text, layer_types)
        head_dims = [int(per_layer.get(i, {}).get("head_dim", head_dim)) for i in range(num_layers)]
        kv_heads = [int(per_layer.get(i, {}).get("num_key_value_heads", num_kv_heads)) for i in range(num_layers)]
        sources = _kv_source_layers(text, layer_types)
        k_eq_v = [bool(text.get("attention_k_eq_v")) and t == "full_attention" for t in layer_types]
        quant = parse_quantization_config(hf, quantization)
        if quant is not None and arch.multimodal:  # its ignore list may spell the VL checkpoint's names
            quant = dataclasses.replace(quant, ignore=text_module_patterns(quant.ignore))
        inter = [int(text["intermediate_size"]) * (2 if text.get("use_double_wide_mlp") and sources[i] != i else 1)
                 for i in range(num_layers)]
        return cls(
            architecture=architecture, hidden_size=text["hidden_size"], num_layers=num_layers,
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            intermediate_size=text["intermediate_size"], vocab_size=text["vocab_size"],
            max_position_embeddings=max_pos, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(full["rope_theta"]),
            rope_scaling=None if full["rope_type"] == "default" else
            {k: v for k, v in full.items() if k != "rope_theta"},
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            qkv_bias=bool(text.get("attention_bias", False)),
            o_bias=bool(text.get("attention_bias", False)) and arch.o_proj_bias,
            qk_norm=bool(text.get("qk_norm", text.get("use_qk_norm", False))),
            sliding_windows=[window if t == "sliding_attention" else None for t in layer_types],
            torch_dtype=str(text.get("dtype") or text.get("torch_dtype") or "float32"),
            bos_token_id=text.get("bos_token_id"),
            eos_token_ids=_eos_ids(text, generation or {}), max_model_len=max_pos,
            quantization=quant,
            model_type=str(text.get("model_type", "")), layer_types=layer_types, rope_parameters=rope,
            partial_rotary_factor=float(text.get("partial_rotary_factor") or 1.0),
            hidden_act=str(text.get("hidden_act") or text.get("hidden_activation") or "silu"),
            norms_per_layer=arch.norms_per_layer, hf_text_config=text, moe=parse_moe_config(text, architecture),
            layer_head_dims=head_dims if len(set(head_dims)) > 1 else [],
            layer_num_kv_heads=kv_heads if len(set(kv_heads)) > 1 else [],
            layer_intermediate_sizes=inter if len(set(inter)) > 1 else [],
            kv_source_layers=sources if sources != list(range(num_layers)) else [],
            k_eq_v_layers=k_eq_v if any(k_eq_v) else [],
            per_layer_input_size=int(text.get("hidden_size_per_layer_input") or 0)
            if architecture.startswith("Gemma4") else 0,
            linear_attention=_linear_attention(text, layer_types), attn_output_gate=arch.attn_output_gate,
            vision=parse_vision_config(hf, architecture))

    @classmethod
    def from_folder(cls, path: str | Path, quantization: str | None = None) -> "ModelConfig":
        """From a model folder's config.json, or from a GGUF file's (or split set's) metadata."""
        path = Path(path)
        if is_gguf(path):
            return cls.from_gguf(path, quantization)
        hf = json.loads((path / "config.json").read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.exists() else {}
        cfg = cls.from_hf_config(hf, generation, quantization)
        if cfg.vision is not None and not any((path / name).exists() for name in IMAGE_PROCESSOR_FILES):
            cfg.vision = None  # a VL folder without its image processor is served as text: its tower never loads
        return cfg

    @classmethod
    def from_gguf(cls, path: str | Path, quantization: str | None = None, check_types: bool = True) -> "ModelConfig":
        """From a GGUF file's (or split set's) metadata; `check_types=False` reads a file with tensor types the
        engine does not load (the planner and the app's library show such files with the reason)."""
        header = read_gguf_header(path, check_types=check_types)
        return cls.from_hf_config(*gguf_hf_config(header), quantization)

    def with_max_model_len(self, max_model_len: int | None) -> "ModelConfig":
        if max_model_len is not None and max_model_len > self.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} is longer than the model's context "
                             f"({self.max_position_embeddings} tokens, max_position_embeddings)")
        self.max_model_len = max_model_len or self.max_position_embeddings
        return self

    def with_image_limit(self, limit: int | None) -> "ModelConfig":
        """Served as text when --limit-mm-per-prompt allows no image (vLLM's text-only mode for a VL checkpoint):
        the tower is then skipped by the loader as for a folder without its image processor, and neither the
        engine's sizing nor the planner counts it."""
        if limit == 0:
            self.vision = None
        return self

    def layer_head_dim(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.layer_num_kv_heads[layer] if self.layer_num_kv_heads else self.num_kv_heads

    def layer_intermediate_size(self, layer: int) -> int:
        return self.layer_intermediate_sizes[layer] if self.layer_intermediate_sizes else self.intermediate_size

    def kv_source(self, layer: int) -> int:
        return self.kv_source_layers[layer] if self.kv_source_layers else layer

    @property
    def cache_layers(self) -> list[int]:
        """The layers that own a paged KV cache, in order: the attention layers but Gemma 4's KV-sharing ones."""
        return [i for i in self.attention_layer_ids if self.kv_source(i) == i]

    def attention_params(self, tp: int = 1) -> tuple[int, int]:
        """(q/k/v/o matrix params, bias and q/k-norm params) over all layers, on one of `tp` cards: K/V heads
        split, replicated below one per card; KV-sharing layers hold only q and o; k_eq_v layers no v."""
        h, matrices, biases, norms = self.hidden_size, 0, 0, 0
        for i in self.attention_layer_ids:
            d = self.layer_head_dim(i)
            q, kv = self.num_heads * d, max(1, self.layer_kv_heads(i) // tp) * tp * d
            q_out = 2 * q if self.attn_output_gate else q  # Qwen3.5's q_proj also gives the output gate
            kv_mats = 0 if self.kv_source(i) != i else 1 if self.k_eq_v_layers and self.k_eq_v_layers[i] else 2
            matrices += h * (q_out + kv_mats * kv) + q * h
            biases += q_out + kv_mats * kv if self.qkv_bias else 0
            norms += (1 + (kv_mats > 0)) * d if self.qk_norm else 0  # q/k norms, replicated
        return matrices // tp, biases // tp + norms

    def per_layer_input_params(self) -> tuple[int, int]:
        """Gemma 4's extras: (the per-layer inputs' [vocab, layers x size] embedding, their projections and
        norms plus each layer's output scalar)."""
        p, n, h = self.per_layer_input_size, self.num_layers, self.hidden_size
        scalars = n if self.architecture.startswith("Gemma4") else 0
        if not p:
            return 0, scalars
        vocab = int(self.hf_text_config.get("vocab_size_per_layer_input") or self.vocab_size)
        return vocab * n * p, h * n * p + p + n * (2 * h * p + h) + scalars

    def mlp_params(self) -> tuple[int, int, int]:
        """(matrix params of every layer's MLP or experts, of what one token goes through, router/bias params)."""
        dense_all = sum(3 * self.hidden_size * self.layer_intermediate_size(i) for i in range(self.num_layers))
        if self.moe is None:
            return dense_all, dense_all, 0
        dense = 3 * self.hidden_size * self.intermediate_size
        total, active, vectors = self.moe.layer_params(self.hidden_size)
        n_moe = len(self.moe.moe_layers)
        n_dense = self.num_layers - n_moe
        return n_moe * total + n_dense * dense, n_moe * active + n_dense * dense, n_moe * vectors

    def _params(self, active: bool) -> int:
        h, v = self.hidden_size, self.vocab_size
        total_mlp, active_mlp, mlp_vectors = self.mlp_params()
        attention, attention_vectors = self.attention_params()
        ple_embedding, ple_rest = self.per_layer_input_params()
        mixers = attention + attention_vectors + self.num_layers * self.norms_per_layer * h
        if self.linear_attention is not None:
            la = self.linear_attention
            mixers += len(la.layers) * (la.matrix_params(h) + la.vector_params())
        return (mixers + (active_mlp if active else total_mlp) + mlp_vectors + ple_embedding + ple_rest
                + v * h * (1 if self.tie_word_embeddings else 2) + h)

    @property
    def num_params(self) -> int:
        """Every weight the model holds: all experts of an MoE model."""
        return self._params(active=False)

    @property
    def num_active_params(self) -> int:
        """The weights one token goes through: the top_k routed experts (and shared experts) of each MoE layer."""
        return self._params(active=True)


def text_config(hf: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The text model's config: `text_config` over the top level (whose own sub-configs are dropped), over the
    family's defaults; a top-level tie_word_embeddings wins, as in transformers. A text-only checkpoint is its
    own text config."""
    top = {k: v for k, v in hf.items() if k not in SUB_CONFIGS}
    text = {**(defaults or {}), **top, **(hf.get("text_config") or {})}
    if "text_config" in hf and "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]  # transformers ties a VL model by the top level
    return text


def text_module_patterns(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """A VL checkpoint's quantization ignore list (modules_to_not_convert, ignore, ignored_layers) with each
    entry that names the text model also in our names: "model.language_model.layers.0.mlp" ->
    "model.layers.0.mlp", "language_model.lm_head" -> "lm_head", likewise inside "re:" patterns (escaped dots
    or not). The entries as given stay, so nothing that matched before stops matching."""
    out = list(patterns)
    for pattern in patterns:
        regex = pattern.startswith("re:")
        body = pattern[3:] if regex else pattern
        for old, new in VL_TEXT_PREFIXES:
            spellings = [(old, new), (old.replace(".", r"\."), new.replace(".", r"\."))] if regex else [(old, new)]
            for o, n in spellings:
                if (body + ("" if regex else ".")).startswith(o):
                    mapped = (n + (body + ("" if regex else "."))[len(o):])
                    mapped = mapped if regex else mapped[:-1]
                    out.append(("re:" if regex else "") + mapped)
    return tuple(dict.fromkeys(out))


def _layer_types(text: dict[str, Any], num_layers: int) -> list[str]:
    """Per layer: HF's `layer_types`; else Gemma-style `sliding_window_pattern` (every Nth layer global);
    else every layer sliding when a window is set and used (Mistral, Qwen2 with use_sliding_window)."""
    window = text.get("sliding_window")
    layer_types = text.get("layer_types")
    if "linear_num_value_heads" in text:  # a hybrid family: HF derives missing layer_types from the interval
        if not layer_types:
            interval = text.get("full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(num_layers)]
        return _checked_layer_types(layer_types, num_layers)
    if window is None or text.get("use_sliding_window") is False:
        return ["full_attention"] * num_layers
    if layer_types:
        checked = _checked_layer_types(layer_types, num_layers)
        if "linear_attention" in checked:
            raise ValueError("config layer_types has 'linear_attention' layers but no linear_num_value_heads "
                             "(this architecture has no Gated DeltaNet layers)")
        return checked
    pattern = text.get("sliding_window_pattern")
    if pattern:
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers


def _per_layer_overrides(text: dict[str, Any], layer_types: list[str]) -> dict[int, dict[str, Any]]:
    """Per-layer shape overrides, either spelling: transformers' saved `per_layer_config` ({"3": {"head_dim":
    512}}) or Gemma 4's hub keys (`global_head_dim`, and `num_global_key_value_heads` where attention_k_eq_v)
    for its full-attention layers."""
    if "per_layer_config" in text:  # saved by transformers, complete (an empty one: no layer differs)
        out = {int(k): dict(v) for k, v in (text["per_layer_config"] or {}).items()}
        bad = [i for i in out if not 0 <= i < len(layer_types)]
        if bad:
            raise ValueError(f"config per_layer_config names layers {bad}; the model has {len(layer_types)} "
                             "(num_hidden_layers)")
        return out
    overrides: dict[str, Any] = {}
    if text.get("global_head_dim"):
        overrides["head_dim"] = text["global_head_dim"]
    if text.get("num_global_key_value_heads") and text.get("attention_k_eq_v", True):
        overrides["num_key_value_heads"] = text["num_global_key_value_heads"]
    return {i: overrides for i, t in enumerate(layer_types) if t == "full_attention"} if overrides else {}


def _kv_source_layers(text: dict[str, Any], layer_types: list[str]) -> list[int]:
    """Gemma 4's KV sharing: the last `num_kv_shared_layers` layers attend over the cache of the last earlier
    layer of their own type (HF's kv_sharing_modes); every other layer over its own."""
    n, shared = len(layer_types), int(text.get("num_kv_shared_layers") or 0)
    if not shared:
        return list(range(n))
    first = n - shared
    if first <= 0:
        raise ValueError(f"config num_kv_shared_layers {shared} leaves no layer of {n} that computes keys and "
                         "values (num_hidden_layers)")
    last_of_type = {t: i for i, t in enumerate(layer_types[:first])}
    missing = sorted(set(layer_types[first:]) - set(last_of_type))
    if missing:
        raise ValueError(f"config num_kv_shared_layers {shared}: no earlier layer of type {missing} to share "
                         "keys and values with")
    return [i if i < first else last_of_type[t] for i, t in enumerate(layer_types)]


def _checked_layer_types(layer_types: list[str], num_layers: int) -> list[str]:
    if len(layer_types) != num_layers:
        raise ValueError(f"config layer_types has {len(layer_types)} entries for {num_layers} layers "
                         "(num_hidden_layers)")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"config layer_types has {', '.join(map(repr, unknown))}; supported: "
                         f"{', '.join(LAYER_TYPES)}")
    return list(layer_types)


def _linear_attention(text: dict[str, Any], layer_types: list[str]) -> LinearAttentionConfig | None:
    """The Gated DeltaNet shape of a hybrid config (HF's linear_* keys), or None without such layers."""
    layers = tuple(i for i, t in enumerate(layer_types) if t == "linear_attention")
    if not layers:
        return None
    num_k, num_v = int(text.get("linear_num_key_heads", 16)), int(text.get("linear_num_value_heads", 32))
    if num_v % num_k:
        raise ValueError(f"linear_num_value_heads ({num_v}) must be a multiple of linear_num_key_heads ({num_k})")
    ssm_dtype = str(text.get("mamba_ssm_dtype") or "float32")
    if ssm_dtype not in DTYPE_BYTES:
        raise ValueError(f"mamba_ssm_dtype {ssm_dtype!r} is not supported; supported: float32, bfloat16, float16")
    return LinearAttentionConfig(layers, num_k, num_v, int(text.get("linear_key_head_dim", 128)),
                                 int(text.get("linear_value_head_dim", 128)),
                                 int(text.get("linear_conv_kernel_dim", 4)), DTYPE_BYTES[ssm_dtype],
                                 bool(text.get("linear_v_heads_tiled")) and num_v != num_k)


def _rope_parameters(text: dict[str, Any], layer_types: list[str]) -> dict[str, dict[str, Any]]:
    """RoPE parameters per layer type, from either HF spelling: `rope_parameters` (transformers 5; flat, or
    keyed by layer type as Gemma 3's) or `rope_scaling` + `rope_theta` (+ Gemma's `rope_local_base_freq`)."""
    given = text.get("rope_parameters") or text.get("rope_scaling") or {}
    per_type = given if any(t in given for t in LAYER_TYPES) else {"full_attention": given}
    theta = text.get("rope_theta", 10000.0)
    local_theta = text.get("rope_local_base_freq")
    out: dict[str, dict[str, Any]] = {}
    for layer_type in ["full_attention"] + sorted(set(layer_types) - {"full_attention", "linear_attention"}):
        params = dict(per_type.get(layer_type) or {})
        if layer_type == "sliding_attention" and "sliding_attention" not in per_type:
            # A model with one table (Mistral) uses it everywhere; Gemma's local layers have their own base.
            params = {"rope_type": "default", "rope_theta": local_theta} if local_theta is not None \
                else dict(out["full_attention"])
        rope_type = params.pop("type", None) or params.get("rope_type") or "default"
        if rope_type == "mrope":  # Qwen2-VL's name: text positions make it the plain table
            rope_type = "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} ({layer_type} layers) is not supported; supported: "
                             f"{', '.join(ROPE_TYPES)}")
        params["rope_type"] = rope_type
        params.setdefault("rope_theta", theta)
        params["rope_theta"] = float(params["rope_theta"])
        if rope_type in ("longrope", "yarn") and text.get("original_max_position_embeddings"):
            params.setdefault("original_max_position_embeddings", text["original_max_position_embeddings"])  # Phi-3
        if "partial_rotary_factor" not in params and text.get("partial_rotary_factor") is not None:
            params["partial_rotary_factor"] = float(text["partial_rotary_factor"])
        out[layer_type] = params
    return out


def _eos_ids(hf: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), hf.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids
