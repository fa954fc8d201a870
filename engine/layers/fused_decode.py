"""When a decoder's CPU decode step runs every layer in one native call (kernels/cpu_decoder.py), and its tensors.

A model qualifies as a whole, once: every layer a plain Llama-style `DecoderLayer` (self-attention, no sandwich
norms) whose attention has no output gate, sinks or soft cap (biases and RMSNorm q/k norms are fine), one RoPE
table (not mRoPE) for all of them and one sliding window (or none), a SiLU `GatedMLP`, float32 weights (a quantized
layer's `--cpu-dequant-cache` copy counts), one tensor-parallel rank, the float32 CPU attention kernel: Llama,
Mistral, Qwen2 and Qwen3 do; SmolLM3 (NoPE layers), Gemma, the MoE and hybrid families keep the modules. A step
qualifies when it is decodes only (one token per sequence, no padding slot), up to the row GEMM's
`NATIVE_MAX_ROWS`, in a process whose CPU backends are the native ones (`--cpu-linear rows` with a C compiler),
with one KV cache group, no image embeddings and no per-token key limits; any other step, and every step on a
card or under a trace, runs the modules, whose outputs the fused call equals bit for bit (to float32 rounding with
q/k norms, which the modules leave to torch).
"""
from __future__ import annotations

import torch.nn.functional as F

from engine.distributed.parallel_state import get_tp_size
from engine.layers.attention import AttentionMetadata
from engine.layers.attention_block import SelfAttention
from engine.layers.norm import RMSNorm
from kernels import cpu_host_ops, cpu_linear
from kernels.cpu_decoder import DecoderLayers, LayerTensors
from kernels.native_kernels import attention_enabled


def _weight(linear):
    """A linear's float32 weight as the kernel reads it, or None (quantized codes without a float copy)."""
    if linear.dequantized is not None:
        return linear.dequantized
    return None if linear.is_quantized() else linear.weight


def _plain_norm(norm) -> bool:
    return isinstance(norm, RMSNorm) and type(norm).forward is RMSNorm.forward


class FusedDecode:
    """A model's layers as the fused call takes them; `__call__` runs a step there, or says it cannot (None)."""

    def __init__(self, layers, layer_class, mlp_class) -> None:
        """Raises ValueError (with the reason) where the model does not qualify."""
        if get_tp_size() != 1:
            raise ValueError("tensor parallel")
        self.attentions, self.modules = [], list(layers)
        first_norm = self.modules[0].input_layernorm if self.modules else None
        for layer in self.modules:
            attn = getattr(layer, "self_attn", None)
            if type(layer).forward is not layer_class.forward or layer.is_linear or layer.sandwich_norms \
                    or type(attn) is not SelfAttention:
                raise ValueError(f"{type(layer).__name__} is not a plain decoder layer")
            if attn.output_gate or attn.attn.sinks is not None or attn.attn.soft_cap is not None \
                    or attn.rotary_emb is None or attn.rotary_emb.mrope_streams is not None or attn.attn.kv_group != 0:
                raise ValueError("an attention variant the kernel does not run")
            mlp = layer.mlp
            if not isinstance(mlp, mlp_class) or type(mlp).forward is not mlp_class.forward or mlp.act is not F.silu:
                raise ValueError(f"{type(mlp).__name__} is not a SiLU gated MLP")
            norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
            norms = norms if attn.q_norm is not None else norms[:2]
            if not all(_plain_norm(n) and type(n) is type(first_norm) and n.eps == first_norm.eps for n in norms):
                raise ValueError("norms of other kinds or epsilons")
            self.attentions.append(attn)
        if not self.attentions:
            raise ValueError("no layers")
        first = self.attentions[0]
        if any(a.rotary_emb is not first.rotary_emb or a.attn.sliding_window != first.attn.sliding_window
               or a.head_dim != first.head_dim for a in self.attentions):
            raise ValueError("layers of different RoPE tables, windows or head widths")
        self.rope = first.rotary_emb
        self.kernel: DecoderLayers | None = None  # made over the bound caches at the first step that can use them

    def _make(self) -> DecoderLayers | None:
        tensors = []
        for layer, attn in zip(self.modules, self.attentions):
            weights = (_weight(attn.qkv_proj), _weight(attn.o_proj), _weight(layer.mlp.gate_up_proj),
                       _weight(layer.mlp.down_proj))
            if any(w is None for w in weights) or attn.attn.k_cache.numel() == 0:
                return None
            linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            tensors.append(LayerTensors(layer.input_layernorm.weight, weights[0], weights[1],
                                        layer.post_attention_layernorm.weight, weights[2], weights[3],
                                        *(linear.bias for linear in linears),
                                        *((None, None) if attn.q_norm is None else (attn.q_norm.weight,
                                                                                    attn.k_norm.weight)),
                                        attn.attn.k_cache, attn.attn.v_cache))
        first, norm = self.attentions[0], self.modules[0].input_layernorm
        try:
            return DecoderLayers(tensors, heads=first.num_heads, kv_heads=first.num_kv_heads,
                                 head_dim=first.head_dim, rotary_dim=self.rope.rotary_dim, eps=norm.eps,
                                 norm_offset=norm.weight_offset, scale=first.attn.scale,
                                 sliding_window=first.attn.sliding_window)
        except ValueError:
            return None

    def __call__(self, x, positions, meta: AttentionMetadata | None):
        """(x, residual) after every layer, or None where this step runs the modules. `x`: the embeddings, the
        forward's own (overwritten)."""
        rows = x.shape[0]
        if meta is None or meta.key_limits is not None or meta.group_block_tables is not None \
                or not 0 < rows <= cpu_linear.NATIVE_MAX_ROWS or x.dim() != 2 or not x.is_contiguous() \
                or positions.dim() != 1 or meta.max_query_len != 1 or not meta.seq_lens.is_cpu \
                or cpu_linear.implementation() != "native" or not (attention_enabled() and cpu_host_ops.available()):
            return None
        attn = self.attentions[0].attn
        step_layout = getattr(attn.paged_attention, "step_layout", None)  # the CPU kernel's (kernels/attention_cpu.py)
        if step_layout is None or not getattr(attn.paged_attention, "takes_new_kv", False):
            return None
        if self.kernel is None or not self.kernel.reads([a.attn.k_cache for a in self.attentions]):
            self.kernel = self._make()
            if self.kernel is None:
                return None
        layout = attn.layout(step_layout, meta, meta.slot_mapping, meta.block_tables)
        if layout.slots is None or layout.decode.size != rows:
            return None
        cos, sin = self.rope.cos_sin_at(positions)
        if cos.dtype != x.dtype or not (cos.is_contiguous() and sin.is_contiguous()):
            return None
        return self.kernel(x, cos, sin, layout)
