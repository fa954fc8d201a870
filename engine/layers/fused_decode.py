"""When a decoder's CPU decode step runs every layer in one native call (kernels/cpu_decoder.py), and its tensors.

A model qualifies as a whole, once: every layer a `DecoderLayer` with self-attention (pre-norm, or Gemma's sandwich
norms), no output gate or sinks (biases, RMSNorm q/k norms, a soft cap are fine), RoPE (not mRoPE) from up to
`MAX_ROPES` tables or none (NoPE layers), up to `MAX_GROUPS` KV cache groups of one sliding window (or none) each, a
SiLU or GELU-tanh `GatedMLP`, float32 weights or a GGUF file's blocks of the types kernels/gguf_gemm.c decodes (a
quantized layer's `--cpu-dequant-cache` copy counts too), one tensor-parallel rank, the float32 CPU attention kernel:
Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 2 and Gemma 3 do; Gemma 4, the MoE and hybrid families keep the
modules. A step qualifies when it is decodes only (one token per sequence, no padding slot), up to the row GEMM's
`NATIVE_MAX_ROWS`, in a process whose CPU backends are the native ones (`--cpu-linear rows` with a C compiler), with no
image embeddings and no per-token key limits; any other step, and every step on a card or under a trace, runs the
modules, whose outputs the fused call equals bit for bit (to float32 rounding with q/k norms, which the modules leave to
torch).
"""
from __future__ import annotations

import weakref

import torch

from engine.distributed.parallel_state import get_tp_size
from engine.layers.attention import AttentionMetadata
from engine.layers.attention_block import SelfAttention
from engine.layers.norm import RMSNorm
from engine.quantization.gguf.method import FLOAT, GgufLinearMethod
from kernels import cpu_host_ops, cpu_linear
from kernels.cpu_decoder import MAX_GROUPS, MAX_ROPES, DecoderLayers, LayerTensors
from kernels.native_kernels import attention_enabled

GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # what kernels/decoder_layers.c applies to the gate


def _weight(linear):
    """A linear's weight as the kernel reads it: float32 (a GGUF file's float matrix too), or a GGUF file's runs of
    blocks; None for other quantized codes without a float copy (and GGUF runs of types it does not decode, which it
    then refuses)."""
    if linear.dequantized is not None:
        return linear.dequantized
    if not linear.is_quantized():
        return linear.weight
    method = linear.method
    if not isinstance(method, GgufLinearMethod) or not method.runs:
        return None
    if [run.type_id for run in method.runs] == [FLOAT]:  # an F32 / F16 / BF16 matrix, in the model's dtype
        return method.run_weight(linear, method.runs[0])
    if all(run.type_id != FLOAT for run in method.runs):
        return tuple((run.type_id, method.run_weight(linear, run)) for run in method.runs)
    return None


def _plain_norm(norm) -> bool:
    return isinstance(norm, RMSNorm) and type(norm).forward is RMSNorm.forward


class FusedDecode:
    """A model's layers as the fused call takes them; `__call__` runs a step there, or says it cannot (None)."""

    def __init__(self, layers, layer_class, mlp_class) -> None:
        """Raises ValueError (with the reason) where the model does not qualify."""
        if get_tp_size() != 1:
            raise ValueError("tensor parallel")
        self.attentions, self.modules = [], list(layers)
        if not self.modules:
            raise ValueError("no layers")
        first_norm, first_mlp = self.modules[0].input_layernorm, self.modules[0].mlp
        for layer in self.modules:
            attn = getattr(layer, "self_attn", None)
            if type(layer).forward is not layer_class.forward or layer.is_linear or type(attn) is not SelfAttention:
                raise ValueError(f"{type(layer).__name__} is not a plain decoder layer")
            if attn.output_gate or attn.attn.sinks is not None \
                    or (attn.rotary_emb is not None and attn.rotary_emb.mrope_streams is not None):
                raise ValueError("an attention variant the kernel does not run")
            mlp = layer.mlp
            if not isinstance(mlp, mlp_class) or type(mlp).forward is not mlp_class.forward \
                    or mlp.act_name not in GATED_ACTIVATIONS or mlp.act_name != first_mlp.act_name:
                raise ValueError(f"{type(mlp).__name__} is not a SiLU or GELU-tanh gated MLP")
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [attn.q_norm, attn.k_norm] if attn.q_norm is not None else []
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm] if layer.sandwich_norms else []
            if not all(_plain_norm(n) and type(n) is type(first_norm) and n.eps == first_norm.eps for n in norms):
                raise ValueError("norms of other kinds or epsilons")
            self.attentions.append(attn)
        first = self.attentions[0]
        if any(a.head_dim != first.head_dim or a.attn.scale != first.attn.scale or a.attn.soft_cap !=
               first.attn.soft_cap for a in self.attentions):
            raise ValueError("layers of different head widths, scales or soft caps")
        # each distinct table once (a layer without positions has none: SmolLM3's NoPE layers)
        self.ropes = list(dict.fromkeys(a.rotary_emb for a in self.attentions if a.rotary_emb is not None))
        groups = sorted({a.attn.kv_group for a in self.attentions})
        if len(self.ropes) > MAX_ROPES or groups != list(range(len(groups))) or len(groups) > MAX_GROUPS:
            raise ValueError(f"{len(self.ropes)} RoPE tables, KV cache groups {groups}")
        # Each group's first layer stands for it: the step's layout is made once per group.
        self.group_layers = [next(a.attn for a in self.attentions if a.attn.kv_group == g) for g in groups]
        if any(a.attn.sliding_window != self.group_layers[a.attn.kv_group].sliding_window for a in self.attentions):
            raise ValueError("layers of one KV cache group with different windows")
        self.kernel: DecoderLayers | None = None  # made over the bound caches (None: they are not what it reads)
        self.made_for: list | None = None  # weak references to the caches it was made for: a rebound pool remakes it

    def _make(self) -> DecoderLayers | None:
        tensors = []
        for layer, attn in zip(self.modules, self.attentions):
            weights = (_weight(attn.qkv_proj), _weight(attn.o_proj), _weight(layer.mlp.gate_up_proj),
                       _weight(layer.mlp.down_proj))
            if any(w is None for w in weights) or attn.attn.k_cache.numel() == 0:
                return None
            linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            tensors.append(LayerTensors(
                layer.input_layernorm.weight, weights[0], weights[1], layer.post_attention_layernorm.weight,
                weights[2], weights[3], *(linear.bias for linear in linears),
                *((None, None) if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)),
                *((layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight)
                  if layer.sandwich_norms else (None, None)),
                attn.attn.k_cache, attn.attn.v_cache))
        first, norm = self.attentions[0], self.modules[0].input_layernorm
        try:
            return DecoderLayers(
                tensors, groups=[a.attn.kv_group for a in self.attentions],
                ropes=[-1 if a.rotary_emb is None else self.ropes.index(a.rotary_emb) for a in self.attentions],
                heads=first.num_heads, kv_heads=first.num_kv_heads, head_dim=first.head_dim,
                rotary_dims=[r.rotary_dim for r in self.ropes],
                windows=[a.sliding_window for a in self.group_layers], eps=norm.eps, norm_offset=norm.weight_offset,
                scale=first.attn.scale, soft_cap=first.attn.soft_cap,
                gelu=self.modules[0].mlp.act_name == "gelu_pytorch_tanh")
        except ValueError:
            return None

    def plan(self, rows: int, positions, meta: AttentionMetadata | None):
        """(each RoPE table's cos and sin, each KV cache group's layout) of a step of `rows` float32 CPU rows that the
        one call can run, or None."""
        if meta is None or meta.key_limits is not None or not 0 < rows <= cpu_linear.NATIVE_MAX_ROWS \
                or positions.dim() != 1 or meta.max_query_len != 1 or not meta.seq_lens.is_cpu \
                or (len(self.group_layers) > 1 and meta.group_block_tables is None) \
                or cpu_linear.implementation() != "native" or not (attention_enabled() and cpu_host_ops.available()):
            return None
        kernel = self.attentions[0].attn.paged_attention
        step_layout = getattr(kernel, "step_layout", None)  # the CPU kernel's (kernels/attention_cpu.py)
        if step_layout is None or not getattr(kernel, "takes_new_kv", False):
            return None
        caches = [a.attn.k_cache for a in self.attentions]
        if self.made_for is None or not all(ref() is cache for ref, cache in zip(self.made_for, caches)):
            self.kernel = self._make()  # once per binding, also where it says no (an FP8 or integer cache)
            self.made_for = [weakref.ref(cache) for cache in caches]
        if self.kernel is None:
            return None
        layouts = [attn.layout(step_layout, meta, *attn.group_tables(meta)) for attn in self.group_layers]
        if any(layout.slots is None or layout.decode.size != rows for layout in layouts):
            return None
        cos_sin = [rope.cos_sin_at(positions) for rope in self.ropes]
        if any(cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()) for cos, sin in cos_sin):
            return None
        return cos_sin, layouts

    def __call__(self, x, positions, meta: AttentionMetadata | None):
        """(x, residual) after every layer, or None where this step runs the modules. `x`: the embeddings, the
        forward's own (overwritten)."""
        if x.dim() != 2 or not x.is_contiguous():
            return None
        planned = self.plan(x.shape[0], positions, meta)
        return None if planned is None else self.kernel(x, *planned)
