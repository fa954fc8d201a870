"""Tiny GGUF files for tests, written on the fly from a tiny Hugging Face model folder as llama.cpp's converter would.

`make_tiny_gguf(tmp, arch, quant)` builds the tiny random model (tests/tiny_models.py), then writes it with the
`gguf` library's GGUFWriter: the hyperparameters under `<arch>.*` keys, the byte-level BPE vocabulary with its
merges, token types (special tokens as control), the special ids and the chat template, and every tensor under
the name gguf-py's own tensor map gives it (independent of the engine's family maps), with llama.cpp's converter
edits — Llama's q/k rows permuted for its RoPE layout, Gemma's norms stored as 1 + w, Llama 3's RoPE scaling as a
`rope_freqs` tensor, Phi-3's LongRoPE factors as `rope_factors_long/short` — and matrices quantized
(tests/gguf_blocks.py: gguf's own quantizer where it has one). A row that is not whole blocks of the chosen type
falls back to Q8_0, then F16, as llama.cpp does.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from gguf_blocks import quantize
from tiny_models import make_tiny_model

# tiny model -> llama.cpp's architecture name (Mistral, Mistral 3's text model included, converts as llama)
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma3": "gemma3",
             "gemma2": "gemma2", "phi3": "phi3", "mistral": "llama", "gpt_oss": "gpt-oss"}
# what llama.cpp's converter leaves out of the file, so the tiny model must match transformers' defaults
TINY_OVERRIDES = {
    "llama": dict(rope_scaling=None),
    "gemma3": dict(layer_types=None, rope_parameters=None, num_hidden_layers=6, sliding_window=8),
}


def make_tiny_gguf(tmp_dir: str | Path, arch: str, quant: str = "F16", *, big: bool = False, seed: int = 0,
                   split_max_tensors: int = 0, file_name: str | None = None, types: dict[str, str] | None = None,
                   **overrides) -> Path:
    """A GGUF of the tiny `arch` model with its matrices in `quant`; `big` makes hidden/intermediate sizes 256/512
    so K-quant super-blocks of 256 fit a row; `types` gives tensors whose GGUF name contains a key that type
    instead (a Q4_K_M file's Q6_K attn_v). Returns the .gguf path (the HF folder is its sibling `tiny-<arch>`,
    for the transformers reference)."""
    import gguf

    kwargs = dict(TINY_OVERRIDES.get(arch, {}))
    if big:
        kwargs.update(hidden_size=256, intermediate_size=512, head_dim=64)
        if arch == "qwen3_moe":
            kwargs.update(moe_intermediate_size=256)
    kwargs.update(overrides)
    if arch.startswith("gemma"):  # llama.cpp scales attention by head_dim (but in the 27B models)
        kwargs["query_pre_attn_scalar"] = kwargs.get("head_dim", 16)
    folder = make_tiny_model(Path(tmp_dir), arch, seed=seed, **kwargs)
    cfg = json.loads((folder / "config.json").read_text())
    path = Path(tmp_dir) / (file_name or f"tiny-{arch}-{quant}.gguf")
    g_arch = GGUF_ARCH[arch]
    writer = gguf.GGUFWriter(str(path), g_arch, split_max_tensors=split_max_tensors)
    _write_metadata(writer, g_arch, cfg, quant)
    _write_tokenizer(writer, folder, cfg["vocab_size"])
    for name, data, qtype in _tensors(folder, g_arch, cfg, quant, types or {}):
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file(path=Path(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        return path.with_name(path.stem + "-00001-of-" + f"{len(list(Path(tmp_dir).glob(path.stem + '-*'))):05d}"
                              + ".gguf")
    return path


def _write_metadata(w, arch: str, cfg: dict, quant: str) -> None:
    import gguf
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(_rope_theta(cfg)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{quant}", gguf.LlamaFileType.MOSTLY_F16))
    if arch in ("qwen3moe", "gpt-oss"):
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    if arch == "gpt-oss":
        w.add_sliding_window(cfg["sliding_window"])
    if arch in ("gemma3", "gemma2"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    scaling = _scaling(cfg)
    if scaling.get("rope_type") in ("llama3", "longrope", "yarn"):
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if scaling.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
    if arch == "phi3":  # the converter writes the rotated dims and 0 for "no sliding window"
        w.add_rope_dimension_count(int(scaling.get("partial_rotary_factor", 1.0) * head_dim))
        w.add_sliding_window(cfg.get("sliding_window") or 0)


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        params = params["full_attention"]
    return params.get("rope_theta") or cfg.get("rope_theta") or 10000.0


def _write_tokenizer(w, folder: Path, vocab_size: int) -> None:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    special = set(tokenizer.all_special_ids)
    added = {t["id"] for t in spec.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
        else:
            tokens.append(by_id[i])
            types.append(3 if i in special else 4 if i in added else 1)  # CONTROL / USER_DEFINED / NORMAL
    merges = spec["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # the split regex transformers 5 gives the tiny tokenizer
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: q/k rows from HF's rotate-half order to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(folder: Path, arch: str, cfg: dict, quant: str, types: dict[str, str]):
    import gguf
    from safetensors.torch import load_file

    weights = {k: v.float().numpy() for k, v in load_file(folder / "model.safetensors").items()}
    n_layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_layers)
    out = []
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, data in weights.items():
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in hf_name else cfg["num_key_value_heads"]
            data = _permute(data, heads)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1
        if arch == "gpt-oss" and ".experts." in hf_name:  # stacked [E, in, out], gate and up interleaved
            out.extend(_gpt_oss_experts(hf_name, data, next((t for k, t in types.items() if "_exps" in k), quant)))
            continue
        if arch == "gpt-oss" and hf_name.endswith(".sinks"):
            out.append((f"blk.{hf_name.split('.')[2]}.attn_sinks.weight", data, gguf.GGMLQuantizationType.F32))
            continue
        if ".experts." in hf_name:  # qwen3moe: per-expert tensors stacked into one per projection
            prefix, expert, proj = hf_name.rsplit(".", 3)[0], int(hf_name.split(".")[-3]), hf_name.split(".")[-2]
            experts.setdefault(f"{prefix}.{proj}", {})[expert] = data
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        out.append(_encoded(gguf_name, data, next((t for k, t in types.items() if k in gguf_name), quant)))
    for key, per_expert in experts.items():
        stacked = np.stack([per_expert[e] for e in range(len(per_expert))])
        layer, proj = key.split(".")[2], key.rsplit(".", 1)[1]
        name = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}[proj]
        out.append(_encoded(f"blk.{layer}.{name}.weight", stacked, quant))
    if _scaling(cfg).get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", _llama3_freqs(cfg), gguf.GGMLQuantizationType.F32))
    if _scaling(cfg).get("rope_type") == "longrope":  # Phi-3: LongRoPE's factors as two tensors
        for kind in ("long", "short"):
            out.append((f"rope_factors_{kind}.weight", np.array(_scaling(cfg)[f"{kind}_factor"], dtype=np.float32),
                        gguf.GGMLQuantizationType.F32))
    return out


def _gpt_oss_experts(hf_name: str, data: np.ndarray, quant: str):
    """llama.cpp's gpt-oss experts: gate and up apart, each [E, out, in]; biases [E, out], F32."""
    import gguf
    layer, leaf = hf_name.split(".")[2], hf_name.rsplit(".", 1)[1]
    if leaf == "gate_up_proj":
        return [_encoded(f"blk.{layer}.ffn_gate_exps.weight", data[:, :, 0::2].transpose(0, 2, 1).copy(), quant),
                _encoded(f"blk.{layer}.ffn_up_exps.weight", data[:, :, 1::2].transpose(0, 2, 1).copy(), quant)]
    if leaf == "down_proj":
        return [_encoded(f"blk.{layer}.ffn_down_exps.weight", data.transpose(0, 2, 1).copy(), quant)]
    f32 = gguf.GGMLQuantizationType.F32
    if leaf == "gate_up_proj_bias":
        return [(f"blk.{layer}.ffn_gate_exps.bias", data[:, 0::2].copy(), f32),
                (f"blk.{layer}.ffn_up_exps.bias", data[:, 1::2].copy(), f32)]
    return [(f"blk.{layer}.ffn_down_exps.bias", data, f32)]


def _encoded(name: str, data: np.ndarray, quant: str):
    import gguf
    from kernels.gguf_torch import BLOCK_FORMATS
    if data.ndim == 1 or quant == "F32" or ".ffn_gate_inp." in name:  # llama.cpp keeps MoE routers in F32
        return name, data.astype(np.float32), gguf.GGMLQuantizationType.F32
    for candidate in (quant, "Q8_0", "F16"):
        block = next(f.block_size for f in BLOCK_FORMATS.values() if f.name == candidate)
        if data.shape[-1] % block == 0:
            break
    qtype = gguf.GGMLQuantizationType[candidate]
    return name, quantize(data, candidate), qtype


def _scaling(cfg: dict) -> dict:
    """The RoPE scaling of a saved config, either spelling (transformers 5 saves rope_parameters)."""
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def _llama3_freqs(cfg: dict) -> np.ndarray:
    s = _scaling(cfg)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = _rope_theta(cfg)
    old, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                              s["factor"])
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_gguf_model(path: Path, config_folder: Path | None = None):
    """transformers' model for a GGUF file (its gguf_file loader dequantizes), float32 on CPU; `config_folder`:
    take the config from that HF folder instead of the file's metadata."""
    from transformers import AutoConfig, AutoModelForCausalLM
    kwargs = {}
    if config_folder is not None:
        kwargs["config"] = AutoConfig.from_pretrained(config_folder)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                **kwargs).eval()
