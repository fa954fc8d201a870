"""The Gemma 4 family: Gemma4ForCausalLM and Gemma4ForConditionalGeneration (images in), dense layers.

Gemma 3's decoder (four norms per layer, GELU-tanh MLP, scaled embeddings, q/k norms, local/global layers on
their own RoPE tables, final soft cap) with these differences, all read from ModelConfig:
- plain RMSNorms (weight, not 1 + w, computed in float32 then cast) and a weightless RMSNorm on V; attention
  scale 1.0 (the q/k norms set the scale);
- global layers with their own shapes: wider heads (`global_head_dim`), fewer KV heads and V equal to K's
  projection (`attention_k_eq_v`, so no v_proj), and "proportional" RoPE (engine/layers/rotary.py). Their
  KV pages differ from the local layers', so each KV head is stored as often as it takes to give every cache
  layer the same page (engine/kv/kv_cache_interface.kv_head_replicas);
- KV sharing: the last `num_kv_shared_layers` layers compute only queries and attend over the cache of the
  last earlier layer of their type (ModelConfig.kv_source); they own no cache, and their k/v tensors, if a
  checkpoint has them, are skipped on purpose (HF skips them too);
- per-layer inputs (the E2B/E4B models): a [vocab, layers x P] embedding plus a projection of the token
  embedding give each layer a P-wide input that gates a residual branch after its MLP; those layers' MLPs are
  twice as wide where `use_double_wide_mlp`;
- a learned `layer_scalar` multiplies each layer's output.
The mixture-of-experts variant (`enable_moe_block`, 26B-A4B) and bidirectional attention over all tokens (`"all"`,
an embedding model) are refused by name. A VL checkpoint keeps the text model under `language_model`; with its
image processor beside it (ModelConfig.vision) the vision tower and `embed_vision` load too
(engine/models/gemma4_vision.py), and as in HF an image's placeholders read the pad token's per-layer embedding
and, where `use_bidirectional_attention` is "vision", an image's tokens see each other both ways on the sliding
layers only (the global layers stay causal, HF's create_masks_for_vision_model). The audio tower and its
embedder are skipped on purpose, audio never taken.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_tp_size
from engine.kv.kv_cache_interface import kv_head_replicas
from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.attention_block import AttentionSwitches
from engine.layers.decoder import DecoderLayer, DecoderModel, DecoderSwitches
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.norm import Gemma4RMSNorm
from engine.layers.linear import LinearBase, QKVParallelLinear, RowParallelLinear, checkpoint_modules
from engine.layers.rotary import RotaryEmbedding, rotary_embeddings
from engine.config.model import ModelConfig
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionModel, encode_image
from engine.models.registry import VL_TEXT_PREFIXES
from engine.models.weights import WeightsMapper


def check_supported(cfg: ModelConfig) -> None:
    text = cfg.hf_text_config
    if text.get("enable_moe_block"):
        raise ValueError(f"{cfg.architecture}: enable_moe_block (Gemma 4's mixture-of-experts layers, e.g. "
                         "gemma-4-26B-A4B) is not supported yet; the dense Gemma 4 models are")
    if text.get("use_bidirectional_attention") == "all":
        raise ValueError(f"{cfg.architecture}: use_bidirectional_attention 'all' (an embedding model) is not "
                         "supported")
    if cfg.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"{cfg.architecture}: hidden_activation {cfg.hidden_act!r} is not supported "
                         "(gelu_pytorch_tanh only)")


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank (the per-layer-input projections: small, and every rank needs all of
    their output)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[param.output_dim] if param.output_dim is not None else 0
        self.load_slice(param, loaded, 0, size, 0)


class Gemma4QKVLinear(QKVParallelLinear):
    """QKVParallelLinear holding only some of q, k, v: k_eq_v layers have no v_proj, KV-sharing layers only
    q_proj. The same head split and loaders; the parameter is as wide as its shards."""

    def __init__(self, shards: tuple[str, ...], hidden_size: int, head_dim: int, num_heads: int,
                 num_kv_heads: int, bias: bool, quant, prefix: str, packed: dict) -> None:
        self.shard_ids = shards
        self.split_heads(head_dim, num_heads, num_kv_heads)
        modules = checkpoint_modules(packed, "qkv_proj")
        if len(modules) == 3:  # q_proj, k_proj, v_proj: only those this layer has
            modules = tuple(m for m, s in zip(modules, "qkv") if s in shards)
        LinearBase.__init__(self, hidden_size, sum(self.output_sizes()), bias, quant, prefix, modules)

    def checkpoint_output_sizes(self) -> list[int]:
        sizes = dict(zip(("q", "k", "v"), super().checkpoint_output_sizes()))
        return [sizes[s] for s in self.shard_ids]

    def output_sizes(self) -> list[int]:
        """This rank's q, k, v widths, as stored."""
        return [(self.num_heads if s == "q" else self.num_kv_heads) * self.head_dim for s in self.shard_ids]


class SharedKVAttention(PagedAttention):
    """A KV-sharing layer's attention: its own queries over `source`'s cache, writing nothing."""

    def __init__(self, source: PagedAttention, num_heads: int, backend: str) -> None:
        super().__init__(num_heads, source.num_kv_heads, source.head_dim, source.sliding_window, backend,
                         scale=source.scale)
        self._source = [source]  # a list, so the source is not registered (and bound) twice

    def forward(self, q, k, v, meta, gate=None):
        src = self._source[0]
        self.k_cache, self.v_cache, self.k_scale, self.v_scale = src.k_cache, src.v_cache, src.k_scale, src.v_scale
        self.kv_group = src.kv_group
        return super().forward(q, None, None, meta, gate)


class Gemma4Attention(nn.Module):
    """Gemma 4's own attention: per-layer head shapes, a weightless norm on V, V = K on k_eq_v layers, KV-sharing
    layers with queries only, KV heads stored `replicas` times for equal pages. Its switches (biases, q/k norm
    class, scale 1.0: the q/k norms set it) are the family's AttentionSwitches."""

    def __init__(self, cfg: ModelConfig, layer: int, switches: AttentionSwitches, rotary_emb: RotaryEmbedding,
                 backend: str, packed: dict, sources: dict[int, PagedAttention]) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.self_attn"
        self.head_dim = d = cfg.layer_head_dim(layer)
        self.owns_kv = cfg.kv_source(layer) == layer
        self.k_eq_v = bool(cfg.k_eq_v_layers) and cfg.k_eq_v_layers[layer]
        shards = ("q", "k") if self.k_eq_v else ("q", "k", "v")
        self.qkv_proj = Gemma4QKVLinear(shards if self.owns_kv else ("q",), cfg.hidden_size, d, cfg.num_heads,
                                        cfg.layer_kv_heads(layer), switches.qkv_bias, cfg.quantization, prefix,
                                        packed)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, switches.o_bias, cfg.quantization,
                                        prefix, ("o_proj",))
        eps, norm = cfg.rms_norm_eps, switches.qk_norm
        self.q_norm = norm(d, eps)
        self.k_norm = norm(d, eps) if self.owns_kv else None
        self.v_norm = Gemma4RMSNorm(d, eps, with_scale=False) if self.owns_kv else None
        self.rotary_emb = rotary_emb
        self.image_both_ways = cfg.layer_types[layer] == "sliding_attention"  # global layers stay causal (HF)
        self.replicas = kv_head_replicas(cfg, get_tp_size())[layer]  # equal KV pages in every cache layer
        if self.owns_kv:
            self.attn = PagedAttention(self.num_heads, self.num_kv_heads * self.replicas, d,
                                       cfg.sliding_windows[layer], backend, scale=switches.scale)
            sources[layer] = self.attn
        else:
            self.attn = SharedKVAttention(sources[cfg.kv_source(layer)], self.num_heads, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        parts = self.qkv_proj(x).split(self.qkv_proj.output_sizes(), dim=-1)
        q = self.q_norm(parts[0].view(-1, self.num_heads, self.head_dim))
        cos, sin = self.rotary_emb.cos_sin_at(positions)
        q = self.rotary_emb._apply(q, cos, sin)
        k = v = None
        if self.owns_kv:
            k = parts[1].view(-1, self.num_kv_heads, self.head_dim)
            v = self.v_norm(k if self.k_eq_v else parts[2].view(-1, self.num_kv_heads, self.head_dim))
            k = self.rotary_emb._apply(self.k_norm(k), cos, sin)
            if self.replicas > 1:
                k, v = k.repeat_interleave(self.replicas, dim=1), v.repeat_interleave(self.replicas, dim=1)
        if meta is not None and meta.key_limits is not None and not self.image_both_ways:
            meta = replace(meta, key_limits=None)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class Gemma4DecoderLayer(DecoderLayer):
    """The sandwich-norm layer without the fused residual (its output is scaled whole by `layer_scalar`), and with
    the per-layer input's gated residual branch after the MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, switches: DecoderSwitches, attention: Gemma4Attention,
                 mlp: nn.Module) -> None:
        super().__init__(cfg, switches, attention, mlp)
        h, p = cfg.hidden_size, cfg.per_layer_input_size
        if p:
            self.per_layer_input_gate = ReplicatedLinear(h, p, False, cfg.quantization, f"model.layers.{layer}",
                                                         ("per_layer_input_gate",))
            self.per_layer_projection = ReplicatedLinear(p, h, False, cfg.quantization, f"model.layers.{layer}",
                                                         ("per_layer_projection",))
            self.post_per_layer_input_norm = switches.norm(h, cfg.rms_norm_eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, positions, x, per_layer_input, meta):
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), meta))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if per_layer_input is not None:
            gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar


class Gemma4Model(DecoderModel):
    def __init__(self, cfg: ModelConfig, switches: DecoderSwitches, layers: Iterable[nn.Module]) -> None:
        super().__init__(cfg, switches, layers)
        h, p, n = cfg.hidden_size, cfg.per_layer_input_size, cfg.num_layers
        self.per_layer_input_size = p
        self.pad_token_id = int(cfg.hf_text_config.get("pad_token_id") or 0)
        if p:
            vocab = int(cfg.hf_text_config.get("vocab_size_per_layer_input") or cfg.vocab_size)
            self.embed_tokens_per_layer = VocabParallelEmbedding(vocab, n * p, scale=p ** 0.5)
            self.per_layer_model_projection = ReplicatedLinear(h, n * p, False, cfg.quantization, "model",
                                                               ("per_layer_model_projection",))
            self.per_layer_projection_norm = Gemma4RMSNorm(p, cfg.rms_norm_eps)
            self.per_layer_model_projection_scale = h ** -0.5  # HF's numbers, python floats as there
            self.per_layer_input_scale = 2.0 ** -0.5

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: the token's own per-layer embedding plus a projection of its (scaled) embedding."""
        n, p = len(self.layers), self.per_layer_input_size
        own = self.embed_tokens_per_layer(input_ids).view(-1, n, p)
        projected = self.per_layer_model_projection(embeds) * self.per_layer_model_projection_scale
        projected = self.per_layer_projection_norm(projected.view(-1, n, p))
        return (projected + own) * self.per_layer_input_scale

    def forward(self, input_ids, positions, meta, mm_embeds=None):
        x = self.embed_input(input_ids, mm_embeds)
        per_layer = None
        if self.per_layer_input_size:  # an image's placeholders read the pad token's own per-layer embedding (HF)
            ids = input_ids if mm_embeds is None else input_ids.index_fill(0, mm_embeds[0], self.pad_token_id)
            per_layer = self.per_layer_inputs(ids, x)
        self.begin_step(positions)
        try:
            for i, layer in enumerate(self.layers):
                x = layer(positions, x, per_layer[:, i] if per_layer is not None else None, meta)
        finally:
            self.end_step()
        return self.norm(x)


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    model_class = Gemma4Model

    @staticmethod
    def decoder_switches(cfg: ModelConfig) -> DecoderSwitches:
        attention = AttentionSwitches(qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=Gemma4RMSNorm, scale=1.0)
        return DecoderSwitches(attention, norm=Gemma4RMSNorm, sandwich_norms=True, embed_scale=cfg.hidden_size ** 0.5)

    check_supported = staticmethod(check_supported)

    def decoder_layers(self, cfg: ModelConfig, backend: str) -> Iterator[nn.Module]:
        ropes = rotary_embeddings(cfg)
        sources: dict[int, PagedAttention] = {}  # cache-owning layers' attention, for the KV-sharing ones
        for i in range(cfg.num_layers):
            attention = Gemma4Attention(cfg, i, self.switches.attention, ropes[cfg.layer_types[i]], backend,
                                        self.packed_modules_mapping, sources)
            mlp = type(self).mlp_factory(cfg, i, self.packed_modules_mapping)  # double-wide on KV-sharing layers
            yield Gemma4DecoderLayer(cfg, i, self.switches, attention, mlp)

    def attention_layers(self) -> list[PagedAttention]:
        """The cache-owning layers' attention, in order: what the KV cache layout's layers are."""
        return [layer.self_attn.attn for layer in self.model.layers if layer.self_attn.owns_kv]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._without_shared_kv(weights))

    def _without_shared_kv(self, weights):
        """KV-sharing layers compute no keys or values: their k/v projections and norms are not loaded."""
        shared = {i for i, layer in enumerate(self.model.layers) if not layer.self_attn.owns_kv}
        for name, tensor in weights:
            mapped = self.weights_mapper.map(name)
            if mapped is not None and shared and ".self_attn." in mapped:
                head, _, tail = mapped.partition(".self_attn.")
                if head.startswith("model.layers.") and int(head.rsplit(".", 1)[1]) in shared \
                        and tail.split(".")[0] in ("k_proj", "v_proj", "k_norm", "v_norm"):
                    continue
            yield name, tensor


# The VL checkpoint's text model is under model.language_model (transformers 5) or language_model.model; served
# as text, its vision and audio towers and their embedders are skipped on purpose.
AUDIO_PARTS, VISION_PARTS = ("audio_tower", "embed_audio"), ("vision_tower", "embed_vision")
GEMMA4_VL_MAPPER = WeightsMapper(
    renamed_prefixes=VL_TEXT_PREFIXES,
    skipped_prefixes=tuple(f"{top}{part}." for top in ("", "model.") for part in VISION_PARTS + AUDIO_PARTS))
# Images in: the tower and embedder load under their own names; audio is still skipped.
GEMMA4_IMAGES_MAPPER = WeightsMapper(
    renamed_prefixes=VL_TEXT_PREFIXES + tuple((f"model.{part}.", f"{part}.") for part in VISION_PARTS),
    skipped_prefixes=tuple(f"{top}{part}." for top in ("", "model.") for part in AUDIO_PARTS))


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The VL checkpoint (E2B, E4B, 31B): the same decoder, plus the vision tower and embedder when it takes
    images; audio skipped."""

    weights_mapper = GEMMA4_VL_MAPPER

    def __init__(self, cfg: ModelConfig, backend: str = "torch") -> None:
        super().__init__(cfg, backend)
        if cfg.vision is not None:
            self.weights_mapper = GEMMA4_IMAGES_MAPPER
            self.vision_tower = Gemma4VisionModel(cfg.vision.tower)
            self.embed_vision = Gemma4VisionEmbedder(cfg.vision.tower, cfg.hidden_size)

    def encode_image(self, data: dict) -> torch.Tensor:
        return encode_image(self.vision_tower, self.embed_vision, data)
