"""Rotary position embedding (rotate-half layout): one factory for every RoPE type the families use.

`rope_inv_freq` turns one layer type's RoPE parameters (ModelConfig.rope_parameters: rope_type, rope_theta
and that type's keys) into inverse frequencies and the attention factor HF multiplies into cos/sin — default,
linear, dynamic NTK, llama3, yarn, longrope, proportional (Gemma 4) — over the rotated share of head_dim (partial rotary: the rest of
each head passes through). mRoPE (Qwen's multimodal RoPE) is the same table read at three position streams (temporal, height, width), each
rotary frequency taking its stream's angle (`use_mrope`: HF's interleaved layout); a step whose positions are one
row (text and decodes: the three streams are equal) reads the plain table.
The float32 cos/sin table is [max_position_embeddings, rotary_dim] (64 MiB at 128k positions and 128 dims),
so `rotary_embeddings` builds ONE per distinct parameter set and every layer of that kind shares it (Gemma 3:
two, its local and global bases); a forward gathers each table's cos/sin at its positions once for all its layers
(`begin_step`). An unsupported type is an error naming it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.config.model import ROPE_TYPES, ModelConfig
from kernels import cpu_host_ops


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.x: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(middle, blended, out)


def yarn_inv_freq(base: float, dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp between the dims whose
    rotations over the original context fall between beta_slow and beta_fast; cos/sin scaled by mscale."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dim ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp  # share of each dim that keeps its original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def longrope_inv_freq(base: float, dim: int, params: dict, max_position: int,
                      max_model_len: int) -> tuple[torch.Tensor, float]:
    """Phi-3/4's LongRoPE: per-dim rescale factors, `long_factor` beyond the original context, else
    `short_factor`. HF switches per forward on the sequence length; a paged cache needs one key per position
    whatever the batch, so the engine chooses once: the long factors when max_model_len exceeds the original
    context (as vLLM does), which is HF's choice for every sequence longer than that context."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = params["long_factor"] if max_model_len > original else params["short_factor"]
    if len(ext) != dim // 2:
        raise ValueError(f"longrope has {len(ext)} rescale factors for {dim // 2} rotary frequencies")
    shape = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base ** shape), float(attention_factor)


def rope_inv_freq(params: dict, rotary_dim: int, max_position: int,
                  max_model_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2], attention factor) of one RoPE parameter set."""
    rope_type, base = params.get("rope_type", "default"), float(params["rope_theta"])
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "dynamic":
        # NTK's base grows only past max_position_embeddings, which max_model_len never exceeds here.
        return inv_freq, 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return yarn_inv_freq(base, rotary_dim, params, max_position)
    if rope_type == "longrope":
        return longrope_inv_freq(base, rotary_dim, params, max_position, max_model_len or max_position)
    if rope_type == "proportional":
        return proportional_inv_freq(base, rotary_dim, params), 1.0
    return inv_freq, 1.0


def proportional_inv_freq(base: float, head_dim: int, params: dict) -> torch.Tensor:
    """Gemma 4's global layers: the first partial_rotary_factor of the frequencies of a full-width table (the
    exponent still over head_dim), the rest zero, so those dims pass through; over the whole head, so the
    rotated pairs are (i, i + head_dim / 2) — unlike partial rotary, which rotates a leading slice."""
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32) / head_dim))
    return torch.cat([rotated, torch.zeros(head_dim // 2 - angles)]) / params.get("factor", 1.0)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float = 10000.0, scaling: dict | None = None,
                 rotary_dim: int | None = None, max_model_len: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim or head_dim
        params = {"rope_type": "default", **(scaling or {}), "rope_theta": base}
        inv_freq, attention_factor = rope_inv_freq(params, self.rotary_dim, max_position, max_model_len)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if attention_factor != 1.0:
            table = table * attention_factor
        self.register_buffer("cos_sin", table, persistent=False)
        self.register_buffer("mrope_streams", None, persistent=False)
        self.step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin): begin_step

    def use_mrope(self, section: tuple[int, ...]) -> None:
        """Read three position streams: frequency j takes the height stream where j % 3 == 1 and j < 3 * section[1],
        the width stream where j % 3 == 2 and j < 3 * section[2], else the temporal one (HF's interleaved mRoPE)."""
        half = self.cos_sin.shape[1] // 2
        j = torch.arange(half)
        streams = torch.zeros(half, dtype=torch.long)
        streams[(j % 3 == 1) & (j < 3 * section[1])] = 1
        streams[(j % 3 == 2) & (j < 3 * section[2])] = 2
        self.mrope_streams = torch.cat([streams, streams]).to(self.cos_sin.device)

    def cos_sin_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, rotary_dim] at `positions` [T] (or mRoPE's [3, T] streams), laid out for `_rotate`:
        (cos, cos) and (-sin, sin) over the two halves. The forward's own when `begin_step` gathered them."""
        step = self.step
        if step is not None and step[0] is positions:
            return step[1], step[2]
        if positions.dim() == 1:
            table = self.cos_sin[positions]
        else:
            streams = self.cos_sin[positions]  # [3, T, rotary_dim]
            pick = self.mrope_streams.view(1, 1, -1).expand(1, streams.shape[1], -1)
            table = streams.gather(0, pick)[0]
        cos, sin = table.unsqueeze(1).chunk(2, dim=-1)
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def begin_step(self, positions: torch.Tensor) -> None:
        """Gather cos/sin at this forward's positions once for every layer sharing the table (DecoderModel.forward;
        `end_step` drops them, so a later forward over the same positions buffer never reads stale ones)."""
        self.step = (positions, *self.cos_sin_at(positions))

    def end_step(self) -> None:
        self.step = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D] rotated at `positions` [T] (or mRoPE's [3, T]), their first rotary_dim
        dims. A float32 decode batch on the CPU whose k follows q in the QKV output: rotated there, in place, by one
        native call (kernels/cpu_host_ops.py) instead of torch's eight ops."""
        cos, sin = self.cos_sin_at(positions)
        if cpu_host_ops.rope_(q, k, cos, sin, self.rotary_dim):
            return q, k
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x rotated by `cos_sin_at`'s cos and sin."""
        if self.rotary_dim == self.head_dim:
            return _rotate(x, cos, sin)
        rot, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([_rotate(rot, cos, sin), rest], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half in float32: x * (cos, cos) + (x2, x1) * (-sin, sin), the halves swapped by one roll — bit for bit
    HF's (x1 cos - x2 sin, x2 cos + x1 sin), in four ops (no cast when x is float32 already)."""
    xf = x if x.dtype == torch.float32 else x.float()
    out = xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * sin
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def get_rope(head_dim: int, max_position: int, params: dict, max_model_len: int | None = None) -> RotaryEmbedding:
    """The RotaryEmbedding of one layer type's parameters (rope_type, rope_theta, partial_rotary_factor, ...)."""
    if params.get("rope_type") == "proportional":  # rotates the whole head, with zero frequencies at the end
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return RotaryEmbedding(head_dim, max_position, params["rope_theta"], scaling, head_dim, max_model_len)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return RotaryEmbedding(head_dim, max_position, params["rope_theta"], scaling, rotary_dim, max_model_len)


def rotary_embeddings(cfg: ModelConfig) -> dict[str, RotaryEmbedding]:
    """One RotaryEmbedding per layer type, shared where two layer types have the same parameters and head
    width (Gemma 4's global layers have wider heads than its local ones)."""
    tables: dict[str, RotaryEmbedding] = {}
    by_params: dict[str, RotaryEmbedding] = {}
    types = cfg.layer_types or ["full_attention"] * cfg.num_layers
    for layer_type, params in cfg.rope_parameters.items():
        head_dim = cfg.layer_head_dim(types.index(layer_type)) if layer_type in types else cfg.head_dim
        key = repr((head_dim, sorted(params.items())))
        if key not in by_params:
            by_params[key] = get_rope(head_dim, cfg.max_position_embeddings, params,
                                      cfg.max_model_len or cfg.max_position_embeddings)
        tables[layer_type] = by_params[key]
    return tables
