"""A GGUF header's metadata as the Hugging Face config.json the engine reads, so ModelConfig has one way in.

llama.cpp's converter writes the hyperparameters under `<arch>.*` keys (context_length, embedding_length,
attention.head_count, rope.freq_base, ...); `gguf_hf_config` maps them back to HF's names for the families the
registry lists under GGUF_ARCHITECTURES, adds what llama.cpp leaves implicit (tied embeddings when there is no
`output.weight`, Gemma's attention scale rule for its 27B models, Qwen3-MoE's normalized top-k) and recovers
Llama 3's RoPE scaling from the `rope_freqs` tensor it writes instead of the config. The ids the model stops at
(tokenizer.ggml.eos/eot/eom_token_id) become the generation config. The file's tensor types become a
`quantization_config` of method "gguf" (engine/quantization/config.py). Phi-3's LongRoPE factors come from
its `rope_factors_long/short` tensors and its partial rotary from `rope.dimension_count`; the hybrids' DeltaNet
shape from the `ssm.*` keys. Torch-free.
"""
from __future__ import annotations

import math
import mmap
import struct
from typing import Any

from engine.config.gguf_file import GgufHeader
from engine.models.registry import GGUF_ARCHITECTURES

# <arch>.<key> -> HF config key, for every architecture
COMMON_KEYS = {
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim", "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping",
    "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}
# Where a family's HF config names a GGUF key otherwise (gpt-oss: its experts' size is intermediate_size)
ARCH_KEYS = {"gpt-oss": {"expert_count": "num_local_experts", "expert_feed_forward_length": "intermediate_size"}}
# Gemma 2/3 27B: llama.cpp scales attention by 1/sqrt(hidden / heads), not 1/sqrt(head_dim) (query_pre_attn_scalar
# 144 / 168 in HF's configs); it tells the 27B by its layer count.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
LLAMA3_ROPE_FACTORS = (8.0, 16.0, 32.0, 64.0)  # what Llama 3.1 / 3.2 / 3.3 checkpoints use
# The hybrids (Gated DeltaNet + gated attention); llama.cpp's qwen35/qwen35moe converter stores the DeltaNet's value
# heads in "tiled" order (engine/models/qwen3_next.py undoes it but for out_proj's columns)
HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
TILED_V_HEADS_ARCHS = ("qwen35", "qwen35moe")


def gguf_hf_config(header: GgufHeader) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) for the model in `header`; a ValueError naming an architecture the
    engine does not serve from GGUF."""
    arch = header.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    if arch == "mistral3" and header.arch_value("attention.temperature_scale") is not None:
        raise ValueError("GGUF architecture 'mistral3' with attention.temperature_scale (Ministral 3's Llama-4 "
                         "attention scaling) is not supported; Mistral-Small-3.x text GGUFs are")
    hf: dict[str, Any] = {"architectures": [GGUF_ARCHITECTURES[arch]], "torch_dtype": "bfloat16"}
    for key, hf_key in {**COMMON_KEYS, **ARCH_KEYS.get(arch, {})}.items():
        value = header.arch_value(key)
        if value is not None:
            hf[hf_key] = _scalar(value, f"{arch}.{key}")
    embed = header.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{header.files[0].name} has no token_embd.weight tensor")
    hf["vocab_size"] = embed.shape[0]
    hf["tie_word_embeddings"] = "output.weight" not in header.tensors
    hf.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    rotary = header.arch_value("rope.dimension_count")
    if rotary and rotary != hf["head_dim"]:  # Phi-4-mini rotates 3/4 of each head
        hf["partial_rotary_factor"] = rotary / hf["head_dim"]
    if not hf.get("sliding_window"):  # llama.cpp writes 0 for "none"
        hf.pop("sliding_window", None)
    hf["rope_scaling"] = _rope_scaling(header, hf)
    if arch in GEMMA_27B_LAYERS:
        hf["model_type"] = "gemma3_text" if arch == "gemma3" else "gemma2"
        big = hf["num_hidden_layers"] == GEMMA_27B_LAYERS[arch]
        hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if big else hf["head_dim"]
    if arch == "qwen3moe":
        hf.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "gpt-oss":  # llama.cpp's swa pattern 2: sliding window on even layers
        hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(hf["num_hidden_layers"])]
        hf.update(attention_bias=True, swiglu_limit=7.0)  # llama.cpp fixes both for gpt-oss
        if hf["rope_scaling"] and hf["rope_scaling"]["rope_type"] == "yarn":
            hf["rope_scaling"]["truncate"] = False  # gpt-oss's YaRN keeps the fractional correction range
    if arch in HYBRID_ARCHS:
        _hybrid(header, hf)
    if arch == "qwen2" and "attention.sliding_window" not in header.metadata:
        hf["use_sliding_window"] = False
    hf["quantization_config"] = {"quant_method": "gguf", **{k: v for k, v in header.bytes_by_type().items()}}
    hf["bos_token_id"] = header.metadata.get("tokenizer.ggml.bos_token_id")
    eos = [header.metadata[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in header.metadata]
    hf["eos_token_id"] = eos[0] if eos else None
    return hf, {"eos_token_id": list(dict.fromkeys(eos)), "bos_token_id": hf["bos_token_id"]}


def _scalar(value: Any, key: str) -> Any:
    if isinstance(value, list):  # per-layer values (llama.cpp writes head_count_kv per layer for some models)
        if len(set(value)) != 1:
            raise ValueError(f"GGUF metadata {key} differs per layer ({value}); not supported")
        return value[0]
    return value


def _hybrid(header: GgufHeader, hf: dict[str, Any]) -> None:
    """Qwen3-Next / Qwen3.5: the DeltaNet's shape from llama.cpp's `ssm.*` keys (group_count = key heads,
    time_step_rank = value heads, state_size = key head dim, inner_size = value dim), the layer kinds from
    `attention.recurrent_layers`, and the MTP (nextn) layers the converter counts in block_count taken out."""
    layers = hf["num_hidden_layers"] - int(header.arch_value("nextn_predict_layers") or 0)
    recurrent = header.arch_value("attention.recurrent_layers")
    if recurrent is None:
        interval = int(header.arch_value("full_attention_interval") or 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    v_heads = int(header.arch_value("ssm.time_step_rank"))
    hf.update(num_hidden_layers=layers,
              layer_types=["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
              linear_num_key_heads=int(header.arch_value("ssm.group_count")), linear_num_value_heads=v_heads,
              linear_key_head_dim=int(header.arch_value("ssm.state_size")),
              linear_value_head_dim=int(header.arch_value("ssm.inner_size")) // v_heads,
              linear_conv_kernel_dim=int(header.arch_value("ssm.conv_kernel")),
              linear_v_heads_tiled=header.architecture in TILED_V_HEADS_ARCHS)
    shared = header.arch_value("expert_shared_feed_forward_length")
    if shared:
        hf["shared_expert_intermediate_size"] = int(shared)
    hf.setdefault("intermediate_size", hf.get("moe_intermediate_size") or hf.get("shared_expert_intermediate_size"))
    if header.architecture == "qwen3next":  # every layer routed, top-k renormalized (as its HF config says)
        hf.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)


def _rope_scaling(header: GgufHeader, hf: dict[str, Any]) -> dict[str, Any] | None:
    """RoPE scaling from `<arch>.rope.scaling.*` (linear, yarn), or Llama 3's recovered from `rope_freqs`."""
    kind = header.arch_value("rope.scaling.type")
    factor = header.arch_value("rope.scaling.factor")
    if "rope_freqs.weight" in header.tensors:
        return _llama3_scaling(header, hf)
    if "rope_factors_long.weight" in header.tensors:  # Phi-3's LongRoPE: its factors as two tensors
        original = int(header.arch_value("rope.scaling.original_context_length"))
        hf["original_max_position_embeddings"] = original
        return {"rope_type": "longrope", "original_max_position_embeddings": original,
                "long_factor": list(_f32_values(header, "rope_factors_long.weight")),
                "short_factor": list(_f32_values(header, "rope_factors_short.weight"))}
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    scaling = {"rope_type": kind, "factor": float(factor)}
    original = header.arch_value("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        for key in ("beta_fast", "beta_slow"):
            value = header.arch_value(f"rope.scaling.yarn_{key}")
            if value is not None:
                scaling[key] = float(value)
    return scaling


def _llama3_scaling(header: GgufHeader, hf: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp writes Llama 3's frequency scaling as a tensor of per-frequency divisors (`rope_freqs`); find
    the llama3 rope_scaling that gives exactly those divisors, or refuse the file by name."""
    divisors = _f32_values(header, "rope_freqs.weight")
    dim, base = hf["head_dim"], float(hf.get("rope_theta", 10000.0))
    original = int(header.arch_value("rope.scaling.original_context_length") or 8192)
    for factor in LLAMA3_ROPE_FACTORS:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": original}
        if _close(_llama3_divisors(dim, base, scaling), divisors):
            return scaling
    raise ValueError(f"{header.files[0].name}: rope_freqs.weight does not match Llama 3's RoPE scaling "
                     f"(factors {LLAMA3_ROPE_FACTORS}, low/high 1/4, original context {original}); not supported")


def _f32_values(header: GgufHeader, name: str) -> tuple[float, ...]:
    """A small F32 tensor's values (RoPE factors), read from the file."""
    info = header.tensors[name]
    if info.type.name != "F32":
        raise ValueError(f"{name} is {info.type.name}, expected F32")
    with open(info.file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return struct.unpack_from(f"<{info.numel}f", data, info.offset)


def _llama3_divisors(dim: int, base: float, s: dict[str, Any]) -> list[float]:
    """What llama.cpp's converter writes for a llama3 rope_scaling: per frequency, the divisor of its inverse."""
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return out


def _close(a: list[float], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 * max(1.0, abs(x)) for x, y in zip(a, b))
