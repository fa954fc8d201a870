"""Torch reference for Gated DeltaNet layers: the short causal conv1d and the gated delta rule over packed
varlen batches, reading and writing per-sequence state slots in place.

Layout (shared with kernels/triton_gated_delta.py and kernels/triton_causal_conv1d.py): all scheduled tokens of all
sequences in one flat [T, ...] tensor, `query_start_loc` [B+1] int32 offsets, one state slot per sequence
(`state_indices` [B]), `has_initial_state` [B] bool (False: the slot is read as zeros, a fresh prompt). A CUDA
graph's padding rows are empty sequences at the end: the tokens past `query_start_loc[-1]` belong to no sequence and
come out as zeros, and an empty sequence leaves its slot alone. The recurrent state is float32 whatever the
activations' dtype. `read_only_state` [B] bool (optional): True rows read their slot but leave it as it was (a
speculative verify row, whose 1 + k tokens may be rejected: the engine later replays only the accepted ones through
these same functions, see engine/spec_decode/state_rollback.py). The math is HF's
(transformers/models/qwen3_next/modeling_qwen3_next.py): prefill rows take the chunked form, vectorised over heads
and chunks; one-token rows (decode) take the recurrent form, batched over sequences. This is the CPU path and the
oracle the Triton kernels are tested against; it imports nothing of ours.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the eps placement of fla and HF)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unknown conv1d activation {activation!r}; choose one of {ACTIVATIONS}")


def _sequence_bounds(query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                     has_initial_state: torch.Tensor, num_tokens: int, num_slots: int) -> list[int]:
    """Check the varlen bookkeeping and return query_start_loc as a host list."""
    starts = query_start_loc.tolist()
    num_seqs = len(starts) - 1
    # Tokens past the last sequence only come with a graph's padding rows, which are empty sequences at the end.
    padded = num_seqs > 0 and starts[-1] == starts[-2] and starts[-1] < num_tokens
    if num_seqs < 0 or starts[0] != 0 or (starts[-1] != num_tokens and not padded):
        raise ValueError(f"query_start_loc must run from 0 to the {num_tokens} tokens; got {starts}")
    if any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"query_start_loc must not decrease; got {starts}")
    if state_indices.shape != (num_seqs,) or has_initial_state.shape != (num_seqs,):
        raise ValueError(f"state_indices {tuple(state_indices.shape)} and has_initial_state "
                         f"{tuple(has_initial_state.shape)} must both be [{num_seqs}] (one per sequence)")
    if num_seqs and (int(state_indices.min()) < 0 or int(state_indices.max()) >= num_slots):
        raise ValueError(f"state_indices must lie in [0, {num_slots}); got {state_indices.tolist()}")
    return starts


def _read_only(read_only_state: torch.Tensor | None, num_seqs: int) -> list[bool]:
    """`read_only_state` as a host list (all False when None); its shape is checked."""
    if read_only_state is None:
        return [False] * num_seqs
    if read_only_state.shape != (num_seqs,):
        raise ValueError(f"read_only_state must be [{num_seqs}] (one per sequence); got "
                         f"{tuple(read_only_state.shape)}")
    return read_only_state.bool().tolist()


def read_only_flags(read_only_state: torch.Tensor | None, num_seqs: int, device) -> torch.Tensor:
    """The Triton kernels' form of `read_only_state`: [num_seqs] int8 on the device (zeros when None), no sync."""
    if read_only_state is None:
        return torch.zeros(num_seqs, dtype=torch.int8, device=device)
    if read_only_state.shape != (num_seqs,):
        raise ValueError(f"read_only_state must be [{num_seqs}] (one per sequence); got "
                         f"{tuple(read_only_state.shape)}")
    return read_only_state.to(torch.int8)


# ---------------------------------------------------------------- causal conv1d

def check_conv1d_inputs(x, weight, bias, conv_states, activation) -> None:
    """Shape checks shared by the torch and Triton conv1d; errors name the tensor and its shape."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"x must be [T, C] and weight [C, K] with K >= 2; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    channels, width = x.shape[1], weight.shape[1]
    if conv_states.dim() != 3 or tuple(conv_states.shape[1:]) != (channels, width - 1):
        raise ValueError(f"conv_states must be [num_slots, {channels}, {width - 1}]; got {tuple(conv_states.shape)}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"bias must be [{channels}]; got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown conv1d activation {activation!r}; choose one of {ACTIVATIONS}")


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
                         has_initial_state: torch.Tensor, activation: str | None = "silu",
                         read_only_state: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv over each sequence, continuing from (and updating in place) its conv-state slot.

    x [T, C]; weight [C, K]; bias [C] or None; conv_states [num_slots, C, K-1] holds each sequence's last K-1
    inputs. Returns act(conv + bias) [T, C] in x.dtype (accumulated in float32). Rows flagged in
    `read_only_state` leave their slot unchanged."""
    check_conv1d_inputs(x, weight, bias, conv_states, activation)
    num_tokens, channels = x.shape
    width = weight.shape[1]
    starts = _sequence_bounds(query_start_loc, state_indices, has_initial_state, num_tokens, conv_states.shape[0])
    slots, fresh = state_indices.tolist(), (~has_initial_state.bool()).tolist()
    keep = _read_only(read_only_state, len(slots))
    w = weight.float()
    b = None if bias is None else bias.float()
    y = torch.empty_like(x)
    y[starts[-1]:] = 0  # tokens of no sequence
    decode = [i for i in range(len(slots)) if starts[i + 1] - starts[i] == 1]
    if decode:  # one token each: a dot product of the window [state, x] with the taps, batched
        rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=x.device)
        idx = state_indices[decode].long()
        prev = conv_states[idx].float()
        prev[torch.tensor([fresh[i] for i in decode], device=x.device)] = 0
        window = torch.cat([prev, x[rows].float().unsqueeze(-1)], dim=-1)  # [n, C, K]
        out = (window * w).sum(-1)
        y[rows] = _activate(out if b is None else out + b, activation).to(x.dtype)
        write = torch.tensor([not keep[i] for i in decode], device=x.device)
        conv_states[idx[write]] = window[write, :, 1:].to(conv_states.dtype)
    for i, slot in enumerate(slots):
        length = starts[i + 1] - starts[i]
        if length <= 1:
            continue
        # zeros, not state * 0: a fresh slot may hold anything, NaN included
        prev = torch.zeros_like(w[:, 1:]) if fresh[i] else conv_states[slot].float()
        window = torch.cat([prev, x[starts[i]:starts[i + 1]].t().float()], dim=-1)  # [C, K-1+L]
        out = F.conv1d(window.unsqueeze(0), w.unsqueeze(1), b, groups=channels)[0]  # [C, L]
        y[starts[i]:starts[i + 1]] = _activate(out, activation).t().to(x.dtype)
        if not keep[i]:
            conv_states[slot] = window[:, -(width - 1):].to(conv_states.dtype)
    return y


# ---------------------------------------------------------------- gated delta rule: single-sequence oracles

def _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel, scale):
    """[B, L, H*, D] inputs -> float32 [B, Hv, L, D] with q/k expanded to the value heads, normalised, scaled."""
    num_k_heads, num_v_heads = key.shape[2], value.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    if num_v_heads != num_k_heads:  # each key head serves num_v_heads // num_k_heads consecutive value heads
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value = (t.transpose(1, 2).float() for t in (query, key, value))
    g, beta = (t.transpose(1, 2).float() for t in (g, beta))
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return query * scale, key, value, g, beta


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule in chunks (HF's argument meaning): q, k [B, L, Hk, Dk], v [B, L, Hv, Dv],
    g/beta [B, L, Hv], initial_state [B, Hv, Dk, Dv] -> (o [B, L, Hv, Dv] in v.dtype, final float32 state).

    Within a chunk the delta-rule corrections u solve (I + A) u = beta * (v - k S0), A the strictly lower
    beta_i (k_i . k_j) exp(c_i - c_j) with c the cumulative log-decay; all chunks solve at once, and only
    the state is carried from chunk to chunk."""
    out_dtype = value.dtype
    q, k, v, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel, scale)
    batch, heads, length, dk = k.shape
    dv = v.shape[-1]
    pad = -length % chunk_size
    if pad:  # padded steps have k = v = beta = 0 and g = 0: they leave the state untouched
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // chunk_size
    q, k, v = (t.reshape(batch, heads, n, chunk_size, -1) for t in (q, k, v))
    g, beta = (t.reshape(batch, heads, n, chunk_size) for t in (g, beta))
    c = g.cumsum(-1)  # log of the decay from the chunk start through each position
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [.., i, j]
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: unitriangular solve
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * c.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * c.exp().unsqueeze(-1)
    k_to_end = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    chunk_decay = c[..., -1].exp()[..., None, None]
    state = (torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=k.device) if initial_state is None
             else initial_state.float().clone())
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + attn[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, n * chunk_size, dv)[:, :, :length].transpose(1, 2).to(out_dtype)
    return out, (state if output_final_state else None)


def _recurrent_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One token for every row: state [N, H, Dk, Dv] updated in place; q, k [N, H, Dk], v [N, H, Dv],
    g, beta [N, H] (float32). Returns o [N, H, Dv]."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("nhkv,nhk->nhv", state, k)
    delta = (v - predicted) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return torch.einsum("nhkv,nhk->nhv", state, q)


def recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token; same arguments and results as chunk_gated_delta_rule."""
    out_dtype = value.dtype
    q, k, v, g, beta = _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel, scale)
    batch, heads, length, dk = k.shape
    state = (torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32, device=k.device)
             if initial_state is None else initial_state.float().clone())
    out = torch.empty_like(v)
    for t in range(length):
        out[:, :, t] = _recurrent_step(state, q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
    return out.transpose(1, 2).to(out_dtype), (state if output_final_state else None)


# ---------------------------------------------------------------- gated delta rule: packed varlen batch

def check_gated_delta_inputs(q, k, v, g, beta, ssm_states) -> None:
    """Shape checks shared by the torch and Triton entry points; errors name the tensor and its shape."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must be [T, Hk, Dk] and v [T, Hv, Dv] with the same T; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (num_tokens, num_v_heads):
            raise ValueError(f"{name} must be [{num_tokens}, {num_v_heads}] (tokens, value heads); "
                             f"got {tuple(t.shape)}")
    if ssm_states.dim() != 4 or tuple(ssm_states.shape[1:]) != (num_v_heads, dk, dv):
        raise ValueError(f"ssm_states must be [num_slots, {num_v_heads}, {dk}, {dv}]; got {tuple(ssm_states.shape)}")
    if ssm_states.dtype != torch.float32:
        raise ValueError(f"ssm_states must be float32 (the recurrent state stays float32); got {ssm_states.dtype}")


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                            query_start_loc: torch.Tensor, has_initial_state: torch.Tensor,
                            scale: float | None = None, use_qk_l2norm: bool = True,
                            chunk_size: int = 64, read_only_state: torch.Tensor | None = None,
                            max_query_len: int | None = None, chunks=None) -> torch.Tensor:
    """The gated delta rule over a packed batch: q, k [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv];
    ssm_states [num_slots, Hv, Dk, Dv] float32 is read and written in place through state_indices (rows
    flagged in `read_only_state` only read theirs). Returns o [T, Hv, Dv] in v.dtype. `max_query_len` (the
    longest row, known on the host) and `chunks` (the step's chunk table, kernels/gated_delta_chunks.py) let
    the Triton twin skip its host syncs; the reference ignores both."""
    check_gated_delta_inputs(q, k, v, g, beta, ssm_states)
    starts = _sequence_bounds(query_start_loc, state_indices, has_initial_state, q.shape[0], ssm_states.shape[0])
    slots, fresh = state_indices.tolist(), (~has_initial_state.bool()).tolist()
    keep = _read_only(read_only_state, len(slots))
    o = torch.empty_like(v)
    o[starts[-1]:] = 0  # tokens of no sequence
    decode = [i for i in range(len(slots)) if starts[i + 1] - starts[i] == 1]
    if decode:
        rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=q.device)
        idx = state_indices[decode].long()
        state = ssm_states[idx]
        state[torch.tensor([fresh[i] for i in decode], device=q.device)] = 0
        qd, kd, vd, gd, bd = _prepare(q[rows].unsqueeze(1), k[rows].unsqueeze(1), v[rows].unsqueeze(1),
                                      g[rows].unsqueeze(1), beta[rows].unsqueeze(1), use_qk_l2norm, scale)
        out = _recurrent_step(state, qd[:, :, 0], kd[:, :, 0], vd[:, :, 0], gd[:, :, 0], bd[:, :, 0])
        o[rows] = out.to(o.dtype)
        write = torch.tensor([not keep[i] for i in decode], device=q.device)
        ssm_states[idx[write]] = state[write]
    for i, slot in enumerate(slots):
        a, b = starts[i], starts[i + 1]
        if b - a <= 1:
            continue
        initial = None if fresh[i] else ssm_states[slot:slot + 1]
        out, final = chunk_gated_delta_rule(q[None, a:b], k[None, a:b], v[None, a:b], g[None, a:b], beta[None, a:b],
                                            chunk_size=chunk_size, initial_state=initial, output_final_state=True,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm, scale=scale)
        o[a:b] = out[0]
        if not keep[i]:
            ssm_states[slot] = final[0]
    return o
