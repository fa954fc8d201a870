"""Checkpoint tensors into a family's parameters, with every shard of every parameter accounted for.

A family declares two things (vLLM's shape): `packed_modules_mapping` — which checkpoint modules stack into
one of our parameters (q/k/v_proj into qkv_proj, gate/up_proj into gate_up_proj) — and a `WeightsMapper` that
renames checkpoint prefixes (a VL checkpoint's `model.language_model.`) and skips the ones the text model does
not load on purpose (vision towers, projectors, MTP heads). `load_weights` then routes each tensor to its
parameter's `weight_loader` with a shard id (None: a fused tensor holding every shard, split by the layer) and
checks at the end that each parameter got each of its shards exactly once. A tensor nobody expects, a shard
loaded twice, or one never loaded is an error that names it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from engine.layers.fused_moe.weights import expert_shard
from engine.models.registry import VL_TEXT_PREFIXES
from engine.quantization.config import QuantConfig
from engine.quantization.gguf.weight import dequantized
from engine.quantization.methods import skipped_tensor

# Checkpoint module -> (our stacked module, shard id), the packing every family with q/k/v and gate/up shares.
PACKED_QKV_GATE_UP = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}


@dataclass(frozen=True)
class WeightsMapper:
    """Checkpoint name -> our name: the first matching renamed prefix is replaced; skipped prefixes and
    suffixes (buffers HF saved, such as rotary inv_freq) are dropped on purpose."""

    renamed_prefixes: tuple[tuple[str, str], ...] = ()
    skipped_prefixes: tuple[str, ...] = ()
    skipped_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    renamed_infixes: tuple[tuple[str, str], ...] = ()  # e.g. Mixtral's ".block_sparse_moe." is our ".mlp."

    def map(self, name: str) -> str | None:
        for old, new in self.renamed_prefixes:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        for old, new in self.renamed_infixes:
            name = name.replace(old, new)
        if name.startswith(self.skipped_prefixes) or name.endswith(self.skipped_suffixes):
            return None
        return name


# A vision-language checkpoint served as text, in both spellings: hub files and transformers 5 on disk
# (language_model.model.*) and transformers 5 in memory (model.language_model.*). The vision tower and the
# projector are skipped on purpose: never loaded, never counted.
VL_TEXT_MAPPER = WeightsMapper(
    renamed_prefixes=VL_TEXT_PREFIXES,
    skipped_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                      "model.multi_modal_projector."))


@dataclass(frozen=True)
class GgufNames:
    """A family's GGUF tensor names (llama.cpp's converter) -> our checkpoint names, and the converter's edits the
    loader undoes (engine/worker/gguf_loader.py): `blk.N.<block name>` is `model.layers.N.<ours>`, the rest by
    `top`; `skipped` tensors are read into the config instead (Llama 3's rope_freqs)."""

    blocks: dict[str, str]
    top: dict[str, str] = field(default_factory=lambda: {
        "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"})
    skipped: tuple[str, ...] = ("rope_freqs.weight",)
    permuted_qk: bool = False  # Llama: q/k rows interleaved for llama.cpp's RoPE
    norm_offset: float = 0.0  # Gemma: every norm weight stored as 1 + w
    # block names that are a bare parameter of ours, with their `.weight`/`.bias` leaf or none (gpt-oss's
    # attn_sinks.weight, the DeltaNet's ssm_a)
    bare: tuple[str, ...] = ()
    # the family's own converter edits, undone per tensor after the renaming: (our name, tensor, ModelConfig) ->
    # (name, tensor) pairs (the hybrids' DeltaNet tensors, engine/models/qwen3_next.py)
    edit: Callable[[str, Any, Any], Iterable[tuple[str, Any]]] | None = None

    def map(self, name: str) -> str | None:
        """Our name for GGUF tensor `name`, None for a skipped one; a ValueError for a name nobody expects."""
        if name in self.skipped:
            return None
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) in (3, 4) and parts[2] in self.blocks:
            ours = f"model.layers.{parts[1]}.{self.blocks[parts[2]]}"
            if parts[2] in self.bare:
                return ours
            if len(parts) == 4:
                return f"{ours}.{parts[3]}"
        stem, _, leaf = name.rpartition(".")
        if stem in self.top:
            return f"{self.top[stem]}.{leaf}"
        raise ValueError(f"GGUF tensor {name!r} has no counterpart in this model family")


# llama.cpp's names for the Llama block (Qwen2/3, Mistral: the same), its MoE experts (Qwen3-MoE) included.
LLAMA_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj"}
LLAMA_GGUF_NAMES = GgufNames(LLAMA_GGUF_BLOCK)


def expected_shards(model: nn.Module) -> dict[str, set]:
    """Every parameter's shard ids: a stacked linear layer's `shard_ids`, else the one shard None. A tied LM
    head shares the embedding's tensor, so it appears once, under the embedding's name."""
    names = dict(model.named_parameters())  # deduplicated: a tied tensor keeps its first name
    expected = {}
    for module_name, module in model.named_modules():
        shard_ids = getattr(module, "shard_ids", (None,))
        for name, param in module.named_parameters(prefix=module_name, recurse=False):
            if name in names:  # stacked experts list (expert, shard) pairs on the parameter itself
                expected[name] = set(getattr(param, "shard_ids", shard_ids))
    return expected


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                 packed_modules_mapping: dict[str, tuple[tuple[str, object], ...]],
                 mapper: WeightsMapper = WeightsMapper(), quant: QuantConfig | None = None,
                 tied_lm_head: bool = False) -> None:
    """Copy (checkpoint name, tensor) pairs into `model`'s parameters through their weight loaders."""
    params = dict(model.named_parameters())
    expected = expected_shards(model)
    loaded: dict[str, set] = {name: set() for name in expected}
    unpack = {f".{part}.": (f".{stacked}.", shard) for stacked, parts in packed_modules_mapping.items()
              for part, shard in parts}
    for ckpt_name, tensor in weights:
        name = mapper.map(ckpt_name)
        if name is None or skipped_tensor(quant, name) or (tied_lm_head and name.startswith("lm_head.")):
            continue
        if _load_expert(params, expected, loaded, ckpt_name, name, tensor):
            continue
        shard_id = None
        for fragment, (stacked, shard) in unpack.items():
            if fragment in name:
                name, shard_id = name.replace(fragment, stacked), shard
                break
        if name not in params:
            raise ValueError(f"checkpoint has a weight {ckpt_name!r} this model does not expect"
                             + (f" (read as {name!r})" if name != ckpt_name else ""))
        shards = expected[name] if shard_id is None else {shard_id}
        twice = shards & loaded[name]
        if twice:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} loads {_shards(name, twice)} a second time")
        param = params[name]
        if not getattr(param, "gguf", False):  # a GGUF tensor in its blocks goes only where blocks are kept
            tensor = dequantized(tensor)
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard_id)
        elif tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, the model's "
                             f"{name!r} is {tuple(param.shape)}")
        else:
            param.data.copy_(tensor)
        loaded[name] |= shards
    missing = [_shards(name, expected[name] - got) for name, got in loaded.items() if expected[name] - got]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))


def _load_expert(params: dict, expected: dict, loaded: dict, ckpt_name: str, name: str,
                 tensor: torch.Tensor) -> bool:
    """An MoE expert tensor (one expert's, or stacked over all experts) into its FusedMoE parameter."""
    hit = expert_shard(name)
    if hit is None:
        return False
    name, expert_id, shard_id = hit
    if name not in params:
        raise ValueError(f"checkpoint has an expert weight {ckpt_name!r} this model does not expect "
                         f"(read as {name!r})")
    param = params[name]
    if not getattr(param, "gguf", False):
        tensor = dequantized(tensor)
    experts = range(param.shape[0]) if expert_id is None else (expert_id,)
    shards = {(e, shard_id) for e in experts}
    twice = shards & loaded[name]
    if twice:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} loads {_shards(name, twice)} a second time")
    param.weight_loader(param, tensor, shard_id, expert_id)
    loaded[name] |= shards
    return True


def _shards(name: str, shard_ids: set) -> str:
    """`name`, or `name` [shards q, k] for the shards of a stacked parameter."""
    if shard_ids == {None}:
        return name
    names = sorted(f"expert {s[0]} {s[1]}" if isinstance(s, tuple) else str(s) for s in shard_ids)
    return f"{name} [shard{'s' if len(shard_ids) > 1 else ''} {', '.join(names)}]"
