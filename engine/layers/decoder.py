"""The decoder the families compose: the gated MLP, the decoder layer and the decoder model (embedding, layers, norm).

A layer is a token mixer (self-attention, engine/layers/attention_block.py, or a hybrid model's Gated DeltaNet)
and an MLP (the gated MLP below, or a family's experts) around norms: pre-norm (two norms, Llama) or Gemma's
"sandwich" (four: each sublayer's output is normed too before it joins the residual). The residual add is fused
into the next norm, so a layer returns (its output, the residual) and the next layer's first norm adds them. What
every layer would redo per forward is done once before them (`DecoderModel.begin_step`: each RoPE table's cos/sin).
`DecoderSwitches` say which of these a family has; the family builds them once from its ModelConfig
(engine/models/*). Module names are the checkpoints' (embed_tokens, layers.N.self_attn / linear_attn, mlp,
input_layernorm, post_attention_layernorm, pre/post_feedforward_layernorm, norm).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.model import ModelConfig
from engine.layers.attention import AttentionMetadata
from engine.layers.attention_block import AttentionSwitches
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear, checkpoint_modules
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.quantization.gguf.types import is_gguf_model
from kernels import cpu_host_ops
from kernels.host_gate import eager_cpu_float32

# HF's hidden_act names -> the function (HF's gelu_pytorch_tanh is torch's tanh approximation), and the native
# act(gate) * up of a CPU decode batch (kernels/cpu_host_ops.py).
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
GATED_HOST_OPS = {"silu": cpu_host_ops.silu_mul, "gelu_pytorch_tanh": cpu_host_ops.gelu_tanh_mul}


@dataclass(frozen=True, slots=True)
class DecoderSwitches:
    attention: AttentionSwitches = field(default_factory=AttentionSwitches)
    norm: type[nn.Module] = RMSNorm  # the hidden-size norms' class (Gemma's: GemmaRMSNorm, applied as 1 + w)
    sandwich_norms: bool = False  # Gemma: four norms per layer, after each sublayer too
    embed_scale: float | None = None  # token embeddings times this (Gemma: sqrt(hidden_size))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up stacked in one column-parallel matrix; act is the config's."""

    def __init__(self, cfg: ModelConfig, layer: int, packed: dict) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"{cfg.architecture}: hidden_act {cfg.hidden_act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        self.act_name, self.act = cfg.hidden_act, ACTIVATIONS[cfg.hidden_act]
        prefix = f"model.layers.{layer}.mlp"
        width = cfg.layer_intermediate_size(layer)  # Gemma 4's KV-sharing layers may be double-wide
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [width] * 2, False, cfg.quantization, prefix,
                                                       checkpoint_modules(packed, "gate_up_proj"))
        self.down_proj = RowParallelLinear(width, cfg.hidden_size, False, cfg.quantization, prefix, ("down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = GATED_HOST_OPS[self.act_name](gate_up)  # a CPU decode batch: one call
        if fused is not None:
            return self.down_proj(fused)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, switches: DecoderSwitches, mixer: nn.Module, mlp: nn.Module) -> None:
        """`mixer`: the layer's SelfAttention (or a family's own attention), or a GatedDeltaNet; `mlp`: any module
        [T, H] -> [T, H]. The mixer is registered first: model.modules() then lists the eager points of the
        piecewise graphs (attention, DeltaNet, torch-loop experts) in forward order."""
        super().__init__()
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = switches.norm(h, eps)
        self.post_attention_layernorm = switches.norm(h, eps)
        self.sandwich_norms = switches.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = switches.norm(h, eps)
            self.post_feedforward_layernorm = switches.norm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`x`: the previous layer's output, still to be added to `residual` (None before the first layer)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, meta) if self.is_linear else self.self_attn(positions, x, meta)
        if not self.sandwich_norms:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, switches: DecoderSwitches, layers: Iterable[nn.Module]) -> None:
        """`layers` may be a generator: they are built after the embedding, in order."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, scale=switches.embed_scale,
                                                   gguf=is_gguf_model(cfg))
        self.layers = nn.ModuleList(layers)
        self.norm = switches.norm(cfg.hidden_size, cfg.rms_norm_eps)
        # The layers' distinct RoPE tables (shared by the layers of a kind): cos/sin gathered once per forward.
        self.ropes = tuple(m for m in self.layers.modules() if isinstance(m, RotaryEmbedding))
        self.fused: object | None = None  # a CPU decode step's layers in one call (fused_decode.py); False: never

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`mm_embeds`: (token rows, embeddings) of a vision-language step's image placeholders."""
        x, residual = self.embed_input(input_ids, mm_embeds), None
        self.begin_step(positions)
        try:
            done = self.fused_layers(x, positions, meta) if mm_embeds is None else None
            if done is not None:
                x, residual = done
            else:
                for layer in self.layers:
                    x, residual = layer(positions, x, residual, meta)
        finally:
            self.end_step()
        x, _ = self.norm(x, residual)
        return x

    def fused_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None):
        """(x, residual) after every layer through one native call on a CPU decode step (engine/layers/fused_decode.py),
        or None: the layers run one by one."""
        fused = self.one_call() if eager_cpu_float32(x) else None
        return None if fused is None else fused(x, positions, meta)

    def one_call(self):
        """The layers as one native call takes them (engine/layers/fused_decode.py), made at the first ask; None
        where this model's layers do not qualify."""
        if self.fused is None:
            from engine.layers.fused_decode import FusedDecode  # it reads this module's classes
            try:
                self.fused = FusedDecode(self.layers, DecoderLayer, GatedMLP)
            except ValueError:
                self.fused = False
        return self.fused or None

    def takes_one_call(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None) -> bool:
        """Whether the eager forward of this step would run its layers as one native call: the compiled CPU forward
        (engine/worker/graphs/cpu_compile.py) leaves such steps to it, which it does not beat."""
        weight = self.norm.weight  # the model's dtype (a GGUF embedding's weight holds blocks)
        if torch.compiler.is_compiling() or not (input_ids.is_cpu and weight.is_cpu and weight.dtype == torch.float32):
            return False
        fused = self.one_call()
        return fused is not None and fused.plan(input_ids.shape[0], positions, meta) is not None

    def begin_step(self, positions: torch.Tensor) -> None:
        """Per forward, what every layer would otherwise redo: each RoPE table's cos/sin at `positions`."""
        for rope in self.ropes:
            rope.begin_step(positions)

    def end_step(self) -> None:
        for rope in self.ropes:
            rope.end_step()

    def embed_input(self, input_ids: torch.Tensor,
                    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Token embeddings, with an image's embeddings in place of its placeholder tokens (after the token
        embedding's scale, as HF's VL models put them: the tower's output is already in the text model's units)."""
        x = self.embed_tokens(input_ids)
        if mm_embeds is None:
            return x
        rows, embeds = mm_embeds
        return x.index_copy(0, rows, embeds.to(x.dtype))
