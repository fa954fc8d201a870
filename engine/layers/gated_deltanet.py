"""The Gated DeltaNet layer of hybrid models (Qwen3-Next, Qwen3.5): projections, short causal conv, the gated
delta rule over a per-sequence recurrent state, a gated RMSNorm and the output projection.

All scheduled tokens of all sequences come as one flat [T, H] batch (`query_start_loc` cuts it), and each
sequence reads and writes its own slot of this layer's state pool in place (`AttentionMetadata.state_indices`;
`has_initial_state` is False for a sequence's first chunk, so a later chunk continues from the state the
previous one left, and a decode takes the recurrent form). A speculative verify row (1 + k query tokens,
`AttentionMetadata.state_read_only`) reads its slot without writing it: the layer keeps the verify tokens'
pre-conv projections, g and beta in its verify scratch, and `replay` later folds only the accepted ones into
the slot (engine/spec_decode/state_rollback.py has the whole protocol). The kernels are kernels/gated_delta_torch.py
(CPU, the oracle) or the Triton ones on CUDA, chosen like the attention backend. The projections come in two
checkpoint spellings: Qwen3-Next's `in_proj_qkvz` / `in_proj_ba`, grouped per key head ([q, k, v, z] and
[b, a] of each key head's value heads), and Qwen3.5's `in_proj_qkv` / `in_proj_z` / `in_proj_b` /
`in_proj_a`. Under tensor parallel each rank keeps whole key heads with their value heads, their conv
channels and their state (the out projection all-reduces). A llama.cpp qwen35 GGUF keeps the value heads tiled;
the loader puts them back but for out_proj's columns (whole quant blocks can span two heads), which get the
layer's output in that order (`out_order`); under tensor parallel, where a rank's columns must be its own heads,
the loader dequantizes that one matrix and puts its columns back instead.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import divide, get_tp_rank, get_tp_size
from engine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from engine.layers.norm import GatedRMSNorm
from engine.config.model import LinearAttentionConfig
from engine.quantization.config import QuantConfig

logger = logging.getLogger("pagedesk.engine")


@functools.cache
def gated_delta_kernels(backend: str):
    """(causal_conv1d_varlen, gated_delta_rule_varlen) of a backend ("torch" or "triton"). Without the Triton
    kernels in this build the torch reference runs on the card too (correct, slower), and the log says so."""
    if backend == "triton":
        try:
            from kernels.triton_causal_conv1d import causal_conv1d_varlen
            from kernels.triton_gated_delta import gated_delta_rule_varlen
            return causal_conv1d_varlen, gated_delta_rule_varlen
        except ImportError as exc:
            logger.warning("Gated DeltaNet Triton kernels unavailable (%s): the torch reference runs instead", exc)
    elif backend != "torch":
        raise ValueError(f"unknown Gated DeltaNet backend {backend!r}; choose 'torch' or 'triton'")
    from kernels.gated_delta_torch import causal_conv1d_varlen, gated_delta_rule_varlen
    return causal_conv1d_varlen, gated_delta_rule_varlen


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, la: LinearAttentionConfig, rms_norm_eps: float, prefix: str,
                 quant: QuantConfig | None = None, split_projections: bool = False, backend: str = "torch",
                 hidden_act: str = "silu") -> None:
        """`split_projections`: Qwen3.5's four input projections instead of Qwen3-Next's two grouped ones."""
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"{prefix}: the DeltaNet conv activation {hidden_act!r} is not supported (silu only)")
        tp = get_tp_size()
        self.num_k_heads = divide(la.num_k_heads, tp, "linear-attention key heads")
        self.num_v_heads = divide(la.num_v_heads, tp, "linear-attention value heads")
        self.head_k_dim, self.head_v_dim, self.conv_kernel = la.head_k_dim, la.head_v_dim, la.conv_kernel
        self.key_dim, self.value_dim = self.num_k_heads * la.head_k_dim, self.num_v_heads * la.head_v_dim
        self.split_projections = split_projections
        if split_projections:
            self.in_proj_qkv = MergedColumnParallelLinear(hidden_size, [la.key_dim, la.key_dim, la.value_dim],
                                                          False, quant, prefix, ("in_proj_qkv",))
            self.in_proj_z = ColumnParallelLinear(hidden_size, la.value_dim, False, quant, prefix, ("in_proj_z",))
            self.in_proj_b = ColumnParallelLinear(hidden_size, la.num_v_heads, False, quant, prefix, ("in_proj_b",))
            self.in_proj_a = ColumnParallelLinear(hidden_size, la.num_v_heads, False, quant, prefix, ("in_proj_a",))
        else:  # grouped per key head: a contiguous split by rank keeps whole key-head groups
            self.in_proj_qkvz = ColumnParallelLinear(hidden_size, 2 * la.key_dim + 2 * la.value_dim, False, quant,
                                                     prefix, ("in_proj_qkvz",))
            self.in_proj_ba = ColumnParallelLinear(hidden_size, 2 * la.num_v_heads, False, quant, prefix,
                                                   ("in_proj_ba",))
        conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Module()  # HF's depthwise nn.Conv1d weight [C, 1, K] (no bias), this rank's channels
        self.conv1d.weight = nn.Parameter(torch.empty(conv_dim, 1, la.conv_kernel), requires_grad=False)
        self.conv1d.weight.weight_loader = self._load_conv
        self._conv_parts = (la.key_dim, la.key_dim, la.value_dim)  # q, k, v channels, all ranks
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        for param in (self.A_log, self.dt_bias):
            param.weight_loader = self._load_heads
        self.norm = GatedRMSNorm(la.head_v_dim, rms_norm_eps)
        self.out_proj = RowParallelLinear(la.value_dim, hidden_size, False, quant, prefix, ("out_proj",))
        order = None  # out_proj's columns in a llama.cpp qwen35 GGUF: the value heads tiled (one rank)
        if la.out_proj_tiled and tp == 1:
            ratio = la.num_v_heads // la.num_k_heads
            order = torch.arange(la.value_dim).view(la.num_k_heads, ratio, la.head_v_dim).transpose(0, 1).reshape(-1)
        self.register_buffer("out_order", order, persistent=False)
        self.causal_conv1d, self.gated_delta_rule = gated_delta_kernels(backend)
        self.conv_state = self.ssm_state = torch.empty(0)
        # speculative verify scratch: per verify token its pre-conv row [C], log-decay g and beta [Hv]
        self.verify_mixed = self.verify_g = self.verify_beta = torch.empty(0)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's q, k and v channels of the checkpoint's [C, 1, K] conv weight."""
        full = sum(self._conv_parts)
        if loaded.dim() == 2:
            loaded = loaded[:, None, :]
        if tuple(loaded.shape) != (full, 1, self.conv_kernel):
            raise ValueError(f"conv1d.weight: checkpoint tensor of shape {tuple(loaded.shape)}, expected "
                             f"({full}, 1, {self.conv_kernel})")
        tp, rank, pieces, start = get_tp_size(), get_tp_rank(), [], 0
        for size in self._conv_parts:
            local = size // tp
            pieces.append(loaded[start + rank * local:start + (rank + 1) * local])
            start += size
        param.data.copy_(torch.cat(pieces))

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """A_log / dt_bias: one value per value head; this rank's heads."""
        total = self.num_v_heads * get_tp_size()
        if tuple(loaded.shape) != (total,):
            raise ValueError(f"A_log/dt_bias: checkpoint tensor of shape {tuple(loaded.shape)}, expected ({total},)")
        param.data.copy_(loaded[get_tp_rank() * self.num_v_heads:(get_tp_rank() + 1) * self.num_v_heads])

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """This layer's slots of the state pool: [num_slots, C, K-1] and [num_slots, Hv, Dk, Dv]."""
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def reserve_verify_rows(self, num_rows: int, dtype: torch.dtype, device: torch.device) -> None:
        """The verify scratch for `num_rows` tokens (max_num_seqs * (1 + k)); g and beta stay float32."""
        self.verify_mixed = torch.zeros((num_rows, self.conv_state_channels), dtype=dtype, device=device)
        self.verify_g = torch.zeros((num_rows, self.num_v_heads), dtype=torch.float32, device=device)
        self.verify_beta = torch.zeros((num_rows, self.num_v_heads), dtype=torch.float32, device=device)

    def verify_scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.verify_mixed, self.verify_g, self.verify_beta))

    def _rule(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_state: torch.Tensor,
              ssm_state: torch.Tensor, indices: torch.Tensor, query_start: torch.Tensor, has_initial: torch.Tensor,
              read_only: torch.Tensor | None, max_len: int | None, chunks=None) -> torch.Tensor:
        """The conv and the gated delta rule over (pre-conv rows, g, beta): the part of the layer that reads
        and writes the state, shared by the forward and the replay. Returns o [T, Hv, Dv]."""
        T = mixed.shape[0]
        mixed = self.causal_conv1d(mixed, self.conv1d.weight[:, 0, :], None, conv_state, indices, query_start,
                                   has_initial, activation="silu", read_only_state=read_only)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return self.gated_delta_rule(q.reshape(T, self.num_k_heads, self.head_k_dim),
                                     k.reshape(T, self.num_k_heads, self.head_k_dim),
                                     v.reshape(T, self.num_v_heads, self.head_v_dim), g, beta, ssm_state, indices,
                                     query_start, has_initial, use_qk_l2norm=True, read_only_state=read_only,
                                     max_query_len=max_len, chunks=chunks)

    def replay(self, rows: torch.Tensor, query_start: torch.Tensor, state_indices: torch.Tensor,
               max_query_len: int) -> None:
        """Fold the accepted verify tokens (`rows` of the verify scratch, a varlen batch cut by `query_start`)
        into their slots, continuing from them; the outputs are not needed."""
        has_initial = torch.ones(state_indices.shape[0], dtype=torch.bool, device=rows.device)
        self._rule(self.verify_mixed[rows], self.verify_g[rows], self.verify_beta[rows], self.conv_state,
                   self.ssm_state, state_indices, query_start, has_initial, None, max_query_len)

    def _project(self, x: torch.Tensor):
        """(q/k/v conv input [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) from either checkpoint layout."""
        T = x.shape[0]
        if self.split_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(T, self.num_v_heads, self.head_v_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        ratio = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(T, self.num_k_heads, 2 * self.head_k_dim + 2 * ratio * self.head_v_dim)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, ratio * self.head_v_dim,
                                 ratio * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(T, self.num_k_heads, 2 * ratio).split([ratio, ratio], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return (mixed, z.reshape(T, self.num_v_heads, self.head_v_dim), b.reshape(T, self.num_v_heads),
                a.reshape(T, self.num_v_heads))

    def _states(self, meta, x: torch.Tensor):
        """(query_start_loc, conv states, ssm states, state indices, has_initial_state). Dummy metadata
        (profiling, warm-up) has no slots: zero temporary states, one per sequence."""
        if meta is None:
            query_start = torch.tensor([0, x.shape[0]], dtype=torch.int32, device=x.device)
        else:
            query_start = meta.query_start_loc
        if meta is not None and meta.state_indices is not None and self.conv_state.numel():
            return query_start, self.conv_state, self.ssm_state, meta.state_indices, meta.has_initial_state
        n = query_start.numel() - 1
        conv = torch.zeros((n, self.conv_state_channels, self.conv_kernel - 1), dtype=x.dtype, device=x.device)
        ssm = torch.zeros((n, self.num_v_heads, self.head_k_dim, self.head_v_dim), dtype=torch.float32,
                          device=x.device)
        return (query_start, conv, ssm, torch.arange(n, dtype=torch.int32, device=x.device),
                torch.zeros(n, dtype=torch.bool, device=x.device))

    @property
    def conv_state_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        T = x.shape[0]
        mixed, z, b, a = self._project(x)
        query_start, conv_state, ssm_state, indices, has_initial = self._states(meta, x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # log-decay, float32 (HF's order)
        read_only = max_len = None
        if getattr(meta, "state_read_only", None) is not None and self.conv_state.numel():
            rows = meta.verify_token_rows  # verify rows: keep what the replay needs, leave the slot alone
            n = rows.shape[0]
            if n > self.verify_mixed.shape[0]:
                raise RuntimeError(f"{n} verify tokens but the verify scratch has {self.verify_mixed.shape[0]} "
                                   "rows (reserve_verify_rows)")
            self.verify_mixed[:n] = mixed[rows]
            self.verify_g[:n] = g[rows]
            self.verify_beta[:n] = beta[rows].float()
            read_only, max_len = meta.state_read_only, meta.max_query_len
        out = self._rule(mixed, g, beta, conv_state, ssm_state, indices, query_start, has_initial, read_only,
                         max_len, getattr(meta, "deltanet_chunks", None))
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        out = out.reshape(T, self.value_dim)
        return self.out_proj(out if self.out_order is None else out.index_select(-1, self.out_order))
