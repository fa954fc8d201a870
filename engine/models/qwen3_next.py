"""Qwen3-Next: the hybrid decoder — Gated DeltaNet layers (engine/layers/gated_deltanet.py) with a
per-sequence state, and every fourth layer (`layer_types`) gated full attention over the paged KV cache.

What differs from Llama besides the DeltaNet layers: (1 + w) RMSNorms everywhere (HF's Qwen3NextRMSNorm,
computed as Gemma's), q/k norms, an output gate in q_proj ([query | gate] per head, out * sigmoid(gate)
before o_proj), partial rotary (a quarter of head_dim by default), and a sparse MoE block with a
sigmoid-gated shared expert on the MoE layers (`decoder_sparse_step`, `mlp_only_layers`). Qwen3.5
(engine/models/qwen3_5.py) is this decoder with its own projection names and mRoPE text positions. Both load
from llama.cpp's GGUFs (qwen3next, qwen35, qwen35moe) with its converter's edits undone (`undo_converter_edits`).
"""
from __future__ import annotations

from typing import Iterable
import logging

import torch
from torch import nn

from engine.config.model import ModelConfig
from engine.distributed.parallel_state import get_tp_size
from engine.layers.attention_block import AttentionSwitches
from engine.layers.decoder import DecoderSwitches
from engine.layers.fused_moe import RouterSpec, SparseMoeBlock
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.config.speculative import MTP_PREFIX  # the head is kept in the checkpoint for speculative decoding
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.models.weights import LLAMA_GGUF_BLOCK, GgufNames, WeightsMapper
from engine.quantization.gguf.types import is_gguf_model
from engine.quantization.gguf.weight import GgufWeight, dequantized

logger = logging.getLogger("pagedesk.engine")

# HF's shared expert and its gate, under our SharedExperts names.
SHARED_EXPERT_INFIXES = ((".mlp.shared_expert_gate.weight", ".mlp.shared_experts.gate"),
                         (".mlp.shared_expert.", ".mlp.shared_experts."))


def hybrid_mlp(cfg: ModelConfig, layer: int, packed: dict) -> nn.Module:
    """The MoE block (shared expert with a sigmoid gate) on MoE layers, else the dense MLP."""
    moe = cfg.moe
    if moe is None or layer not in moe.moe_layers:
        return LlamaMLP(cfg, layer, packed)
    return SparseMoeBlock(RouterSpec(**moe.router_spec_kwargs()), cfg.hidden_size, moe.intermediate_size,
                          activation=moe.activation, shared_intermediate_size=moe.shared_intermediate_size,
                          shared_gate=moe.shared_gate, quant=cfg.quantization,
                          prefix=f"model.layers.{layer}.mlp")


def undo_converter_edits(name: str, tensor, cfg: ModelConfig):
    """llama.cpp's qwen3next / qwen35 converter edits, undone: every (1 + w) norm but the DeltaNet's gated one
    stored with the 1 added; A_log stored as A = -exp(A_log); Qwen3-Next's in_proj_ba kept grouped per key head
    ([b, a] of its value heads) while its in_proj_qkvz is split into the qkv and z tensors of Qwen3.5's layout
    (so a Qwen3-Next GGUF builds the split projections); and in a qwen35 file (`out_proj_tiled`) the value heads
    of qkv's v rows, z, b, a, A_log, dt_bias and the conv's v channels tiled (head j of every key head, then
    j + 1) for ggml's broadcast, put back grouped: rows only, out_proj's columns are the layer's `out_order` on one
    rank; under tensor parallel that matrix is dequantized (its blocks can span two heads) and its columns moved."""
    la = cfg.linear_attention
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        yield name, tensor.to(torch.float32) - 1.0
        return
    if name.endswith("linear_attn.A_log"):
        tensor = torch.log(-tensor.to(torch.float32))
    if name.endswith("linear_attn.in_proj_ba.weight"):
        rows = torch.arange(2 * la.num_v_heads).view(la.num_k_heads, 2, la.num_v_heads // la.num_k_heads)
        stem = name.removesuffix("in_proj_ba.weight")
        yield f"{stem}in_proj_b.weight", _rows(tensor, rows[:, 0].reshape(-1))
        yield f"{stem}in_proj_a.weight", _rows(tensor, rows[:, 1].reshape(-1))
        return
    if la.out_proj_tiled:
        qk = torch.arange(2 * la.key_dim)
        order = {"in_proj_qkv.weight": torch.cat([qk, qk.numel() + _grouped(la, la.head_v_dim)]),
                 "conv1d.weight": torch.cat([qk, qk.numel() + _grouped(la, la.head_v_dim)]),
                 "in_proj_z.weight": _grouped(la, la.head_v_dim), "in_proj_b.weight": _grouped(la, 1),
                 "in_proj_a.weight": _grouped(la, 1), "A_log": _grouped(la, 1), "dt_bias": _grouped(la, 1)}
        leaf = name.partition(".linear_attn.")[2]
        if leaf in order:
            tensor = _rows(tensor, order[leaf])
        elif leaf == "out_proj.weight" and get_tp_size() > 1:
            tensor = dequantized(tensor).index_select(1, _grouped(la, la.head_v_dim))
    yield name, tensor


def _grouped(la, head_dim: int) -> torch.Tensor:
    """For each grouped row (key head g, its value head j, e), the tiled row holding it ((j, g, e))."""
    ratio = la.num_v_heads // la.num_k_heads
    return torch.arange(la.num_v_heads * head_dim).view(ratio, la.num_k_heads, head_dim).transpose(0, 1).reshape(-1)


def _rows(tensor, order: torch.Tensor):
    return tensor.index_rows(order) if isinstance(tensor, GgufWeight) else tensor.index_select(0, order)


# llama.cpp's names for the hybrids' tensors (qwen3next, qwen35, qwen35moe)
HYBRID_GGUF_NAMES = GgufNames({
    **LLAMA_GGUF_BLOCK, "post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba", "ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"},
    bare=("ssm_a", "ssm_dt"), edit=undo_converter_edits)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    mlp_factory = hybrid_mlp
    gguf_names = {"qwen3next": HYBRID_GGUF_NAMES}
    weights_mapper = WeightsMapper(skipped_prefixes=(MTP_PREFIX,), renamed_infixes=SHARED_EXPERT_INFIXES)
    split_projections = False  # the DeltaNet's input projections: fused (Qwen3-Next) or stored split (Qwen3.5)

    @staticmethod
    def decoder_switches(cfg: ModelConfig) -> DecoderSwitches:
        """Gated full attention with (1 + w) q/k norms; (1 + w) norms everywhere (HF's Qwen3NextRMSNorm)."""
        attention = AttentionSwitches(qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=GemmaRMSNorm,
                                      output_gate=True)
        return DecoderSwitches(attention, norm=GemmaRMSNorm)

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        if cfg.linear_attention is None:
            raise ValueError(f"{cfg.architecture}: the config has no linear_attention layers (layer_types)")
        if cfg.sliding_windows and any(cfg.sliding_windows):
            raise ValueError(f"{cfg.architecture}: sliding-window layers are not supported in a hybrid model")
        super().__init__(cfg, backend)

    def token_mixer(self, cfg: ModelConfig, layer: int, ropes: dict[str, RotaryEmbedding],
                    backend: str) -> nn.Module:
        """A Gated DeltaNet on the linear-attention layers, the gated self-attention on the others."""
        if cfg.layer_types[layer] != "linear_attention":
            return super().token_mixer(cfg, layer, ropes, backend)
        return GatedDeltaNet(cfg.hidden_size, cfg.linear_attention, cfg.rms_norm_eps,
                             f"model.layers.{layer}.linear_attn", cfg.quantization,
                             self.split_projections or is_gguf_model(cfg), backend, cfg.hidden_act)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skipped = []

        def without_mtp(pairs):
            for name, tensor in pairs:
                if name.startswith(MTP_PREFIX):  # kept aside: the speculative-decoding head, not loaded here
                    skipped.append(name)
                    continue
                yield name, tensor

        super().load_weights(without_mtp(weights))
        if skipped:
            logger.info("%s: %d multi-token-prediction tensors (mtp.*) are not the target's (speculative method "
                        "\"mtp\" loads them as its head)", self.config.architecture, len(skipped))
        self.skipped_mtp_tensors = skipped
