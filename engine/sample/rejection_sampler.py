"""Rejection sampler: verify k draft tokens per sequence against the target's logits at the 1 + k positions.

Row j of a sequence (j < k) holds the target's logits after the sequence plus drafts[:j], with that row's
sampling state already applied by the caller (penalties, bad_words, min_tokens, logit bias and grammar
bitmask see the drafts before it, as `SamplingRow`s built per position); row k is the bonus position.

- Greedy rows accept draft j while it equals the argmax; the first mismatch emits the argmax instead.
- Sampled rows accept draft j with probability min(1, p(d)/q(d)); on rejection they draw from the
  normalised (p - q)+, and when every draft is accepted they draw a bonus token from p at row k. With
  q the draft's distribution this leaves the output distributed exactly as p (Leviathan et al. 2023).
  N-gram drafts are deterministic, q is one-hot: accept with p(d), on rejection draw from p with d removed.

p is the target's distribution after temperature and top-k/top-p/min-p, as the ordinary sampler draws.
Draws use the exponential race (argmax of w / E, E ~ Exp(1)), exact for unnormalised weights w, with a
seeded row's own generator. Only [rows]-sized results cross to the host, in one copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.platform.host_copies import to_device
from engine.sample.sampler import apply_bias_and_masks, apply_penalties, filter_top_k_top_p_min_p
from engine.sample.state import SamplingMetadata


@dataclass(slots=True)
class SpecSampleOutput:
    """Per sequence, the tokens it emits this step (accepted drafts, then one more) and their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]  # the target's raw log-prob of each emitted token
    num_accepted: list[int]  # drafts accepted per sequence
    top_ids: list[list[list[int]]] | None = None  # per sequence, per emitted token (when logprobs are asked)
    top_logprobs: list[list[list[float]]] | None = None
    ranks: list[list[int]] | None = None


def _race(weights: torch.Tensor, generators: list, default: torch.Generator | None) -> torch.Tensor:
    """One draw per row from unnormalised `weights` (argmax of w / E), each row's generator or the default."""
    noise = torch.empty_like(weights)
    noise.exponential_(generator=default)
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    return torch.div(weights, noise, out=noise).argmax(dim=-1)  # in place: no third [rows, vocab] tensor


def _uniform(n: int, generators: list, default: torch.Generator | None, device) -> torch.Tensor:
    u = torch.rand(n, generator=default, device=device)
    for i, gen in enumerate(generators):
        if gen is not None:
            u[i] = torch.rand(1, generator=gen, device=device)[0]
    return u


def rejection_sample(logits: torch.Tensor, meta: SamplingMetadata, draft_token_ids: list[list[int]],
                     default_generator: torch.Generator | None,
                     draft_probs: torch.Tensor | None = None) -> SpecSampleOutput:
    """`logits`: [sum(1 + k_i), vocab], sequence i's 1 + k_i rows in order; `meta` built over the same rows
    (one `SamplingRow` per position, all with the sequence's params and generator); `draft_probs`: the
    draft's q at each draft row [sum(k_i), vocab], or None for deterministic (n-gram, or greedy) drafts."""
    dev, vocab = logits.device, logits.shape[1]
    num_drafts = [len(d) for d in draft_token_ids]
    num_rows = sum(num_drafts) + len(num_drafts)
    assert logits.shape[0] == num_rows, f"{logits.shape[0]} logits rows for {num_rows} verify rows"
    # Row layout: which rows hold a draft, and the draft they verify (bonus rows get -1).
    row_draft = torch.full((num_rows,), -1, dtype=torch.long)
    is_bonus = torch.zeros(num_rows, dtype=torch.bool)
    draft_rows, row = [], 0
    for drafts in draft_token_ids:
        row_draft[row:row + len(drafts)] = torch.as_tensor(drafts, dtype=torch.long)
        draft_rows += range(row, row + len(drafts))
        row += len(drafts)
        is_bonus[row] = True
        row += 1
    row_draft, is_bonus = to_device(row_draft, dev), to_device(is_bonus, dev)
    draft_rows_t = to_device(torch.as_tensor(draft_rows, dtype=torch.long), dev)

    raw = logits
    work = logits.to(torch.float32, copy=True)
    apply_bias_and_masks(work, meta)
    apply_penalties(work, meta)
    emit = work.argmax(dim=-1)  # greedy rows: the argmax, whether the draft matched or not
    accept = (emit == row_draft) & ~is_bonus
    if meta.sampled_rows is not None:
        s_rows = meta.sampled_rows
        # Full-vocabulary temporaries are the verify step's peak (counted per logit by the planner): each is
        # dropped as soon as it is read for the last time.
        scaled = work[s_rows]
        del work
        p = torch.softmax(scaled.div_(meta.temperature[:, None]), dim=-1)
        del scaled
        p = filter_top_k_top_p_min_p(p, meta)
        s_draft = row_draft[s_rows]
        s_has_draft = s_draft >= 0
        safe_draft = s_draft.clamp(min=0)
        p_d = p.gather(1, safe_draft[:, None])[:, 0]
        if draft_probs is None:  # q one-hot at the draft
            q_d = torch.ones_like(p_d)
            residual = p.scatter(1, safe_draft[:, None], 0.0)
        else:
            # Map each sampled draft row to its row of draft_probs (rows are in the same order).
            q = torch.zeros_like(p)
            index_in_drafts = torch.full((num_rows,), -1, dtype=torch.long, device=dev)
            index_in_drafts[draft_rows_t] = torch.arange(len(draft_rows), device=dev)
            s_idx = index_in_drafts[s_rows]
            with_q = s_idx >= 0
            q[with_q] = draft_probs[s_idx[with_q]].to(p.dtype)
            q_d = q.gather(1, safe_draft[:, None])[:, 0]
            residual = (p - q).clamp_(min=0.0)
            del q
        # Bonus rows, and residuals that vanish (p == q up to rounding: a rejection there is measure zero),
        # draw from p itself.
        empty = residual.sum(dim=-1) <= 0
        residual = torch.where((~s_has_draft | empty)[:, None], p, residual)
        gens = meta.generators
        u = _uniform(len(s_rows), gens, default_generator, dev)
        s_accept = s_has_draft & (u * q_d < p_d)
        drawn = _race(residual, gens, default_generator)
        del p, residual
        emit.index_copy_(0, s_rows, torch.where(s_accept, s_draft, drawn))
        accept.index_copy_(0, s_rows, s_accept)
    raw_logprobs = torch.log_softmax(raw.float(), dim=-1)
    token_logprobs = raw_logprobs.gather(1, emit[:, None])[:, 0]
    parts = [emit[:, None].double(), token_logprobs[:, None].double(), accept[:, None].double()]
    k_top = meta.max_num_logprobs
    if k_top is not None:
        top = raw_logprobs.topk(max(k_top, 1), dim=-1)
        ranks = (raw_logprobs > token_logprobs[:, None]).sum(dim=-1) + 1
        parts += [ranks[:, None].double(), top.indices.double(), top.values.double()]
    packed = torch.cat(parts, dim=1).cpu().tolist()  # the one device -> host copy
    out = SpecSampleOutput([], [], [], [] if k_top is not None else None, [] if k_top is not None else None,
                           [] if k_top is not None else None)
    row = 0
    for k in num_drafts:
        accepted = 0
        while accepted < k and packed[row + accepted][2] > 0.5:
            accepted += 1
        rows = packed[row:row + accepted + 1]
        out.token_ids.append([int(r[0]) for r in rows])
        out.logprobs.append([r[1] for r in rows])
        out.num_accepted.append(accepted)
        if k_top is not None:
            width = max(k_top, 1)
            out.ranks.append([int(r[3]) for r in rows])
            out.top_ids.append([[int(t) for t in r[4:4 + width]] for r in rows])
            out.top_logprobs.append([r[4 + width:4 + 2 * width] for r in rows])
        row += k + 1
    return out


def prepare_verify(spec, vocab_size: int, dev: torch.device) -> tuple[SamplingMetadata, torch.Tensor]:
    """A step's SpecBatch as device tensors, made before the forward like the sampler's (asynchronous copies)."""
    meta = SamplingMetadata.build(spec.rows, vocab_size, dev)
    if spec.bitmask is not None:
        meta.bitmask = to_device(spec.bitmask, dev)
    return meta, to_device(torch.tensor(spec.logits_index, dtype=torch.long), dev)


def verify_drafts(logits: torch.Tensor, spec, generator: torch.Generator | None,
                  prepared: tuple[SamplingMetadata, torch.Tensor] | None = None) -> SpecSampleOutput:
    """The model runner's entry: a step's SpecBatch (engine/spec_decode/speculator.py) over its logits."""
    meta, index = prepared or prepare_verify(spec, logits.shape[1], logits.device)
    # The verify rows first and in order (a step of verify rows only): a view, not another [rows, vocab] copy
    # beside the step's logits.
    rows = logits[:len(spec.logits_index)] if spec.logits_index == list(range(len(spec.logits_index))) \
        else logits[index]
    return rejection_sample(rows, meta, spec.draft_token_ids, generator, spec.draft_probs)
