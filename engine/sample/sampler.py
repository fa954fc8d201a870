"""Sampler: the logits of one step's sampling rows -> next tokens, their logprobs and the top-k logprobs.

Order, as in vLLM: logit bias, min_tokens (EOS and stop ids masked), the structured-output bitmask,
repetition / presence / frequency penalties, then temperature, top-k, top-p, min-p, then a draw. The draw
is an exponential race (argmax of p / E with E ~ Exp(1)), which is exactly sampling from p; a seeded
request draws its noise from its own generator, so its output never depends on what else is in the batch.
Logprobs are those of the model's raw distribution; a step whose rows ask none skips even the chosen tokens'
when its caller reads none (the engine: `SamplingBatch.chosen_logprobs`). Everything runs on the logits'
device over the whole batch (`SamplingMetadata` tensors, one sort for the filters); only the small results
cross to the host, in one transfer (`SampledTokens.to_host`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from engine.sample.metadata import SamplingRow

from engine.sample.state import SamplingMetadata

TOP_P_GUESS = 512  # CPU: tokens a top-p filter first looks among before it sorts the vocabulary

__all__ = ["SamplerOutput", "SamplingRow", "apply_penalties", "sample", "sample_on_device", "beam_top_logprobs"]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen token; None: not computed (no row asked, nor the caller)
    top_ids: list[list[int]] | None  # per row, the top-k ids by logprob (k = max requested)
    top_logprobs: list[list[float]] | None
    ranks: list[int] | None  # rank of the chosen token


@dataclass(slots=True)
class SampledTokens:
    """The sampler's results, still on the device."""

    token_ids: torch.Tensor  # [rows] long
    logprobs: torch.Tensor | None  # [rows] float32; None: not computed
    top_ids: torch.Tensor | None  # [rows, k] long
    top_logprobs: torch.Tensor | None  # [rows, k] float32
    ranks: torch.Tensor | None  # [rows] long

    def to_host(self) -> SamplerOutput:
        """One device -> host copy: every result packed into float64 (token ids < 2**53 stay exact)."""
        packed = self._pack()
        # .cpu() of a host tensor is still a dispatched op: a batch-1 step's host path counts them
        return self._unpack((packed if packed.device.type == "cpu" else packed.cpu()).tolist())

    def start_host_copy(self) -> "PendingSamples":
        """The same copy, started without waiting for it (async scheduling): into pinned memory on a card, with
        an event recorded after it, so the host goes on while the device is still computing these."""
        packed = self._pack()
        if packed.device.type != "cuda" or not torch.cuda.is_available():
            return PendingSamples(self, packed, None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingSamples(self, host, event)

    def _pack(self) -> torch.Tensor:
        if self.logprobs is None:  # the ids alone: nothing to pack (a greedy step without logprobs)
            return self.token_ids
        if self.ranks is None:  # the common step: the stack promotes the long ids to float64 itself
            return torch.stack((self.token_ids, self.logprobs.double()), dim=1)
        parts = [self.token_ids[:, None], self.logprobs[:, None], self.ranks[:, None], self.top_ids, self.top_logprobs]
        return torch.cat([p.double() for p in parts], dim=1)

    def _unpack(self, packed: list) -> SamplerOutput:
        if self.logprobs is None:
            return SamplerOutput(packed, None, None, None, None)
        out = SamplerOutput([int(r[0]) for r in packed], [r[1] for r in packed], None, None, None)
        if self.ranks is not None:
            k = self.top_ids.shape[1]
            out.ranks = [int(r[2]) for r in packed]
            out.top_ids = [[int(t) for t in r[3:3 + k]] for r in packed]
            out.top_logprobs = [r[3 + k:] for r in packed]
        return out


@dataclass(slots=True)
class PendingSamples:
    """Sampled tokens on their way to the host: the device tensors (the next step reads `tokens.token_ids` on
    the device), the host copy being made and the event after it."""

    tokens: SampledTokens
    host: torch.Tensor  # packed as SampledTokens._pack; the device's own tensor when the device is the host
    event: object | None  # torch.cuda.Event, recorded after the copy

    def wait(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        return self.tokens._unpack(self.host.tolist())


def apply_bias_and_masks(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    if meta.bias is not None:
        rows, ids, values = meta.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if meta.masked is not None:
        rows, ids = meta.masked
        # torch.full, not torch.tensor(..., device=): a fill kernel, where a pageable host copy would wait
        logits.index_put_((rows, ids), torch.full((), float("-inf"), device=logits.device))
    if meta.bitmask is not None:
        apply_token_bitmask(logits, meta.bitmask)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf wherever the packed int32 bitmask has a 0 bit (xgrammar's layout)."""
    # unsqueeze/view/narrow rather than indexing: fake CUDA tensors on a CPU-only torch accept only these.
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(bitmask.shape[0], -1).narrow(1, 0, logits.shape[1])
    logits.masked_fill_(allowed == 0, float("-inf"))


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata | list[SamplingRow]) -> None:
    """Repetition penalty on every token seen (prompt or output); presence/frequency on output counts, read
    from the sampling state's persistent buffers at the penalized rows' slots."""
    if isinstance(meta, list):
        meta = SamplingMetadata.build(meta, logits.shape[1], logits.device)
    if meta.penalty_rows is None:
        return
    vocab = logits.shape[1]
    rows = logits[meta.penalty_rows]
    counts = meta.output_counts.index_select(0, meta.penalty_slots).narrow(1, 0, vocab)
    # The same values as where(seen, where(rows > 0, rows / p, rows * p), rows) and rows -= f * counts + p * seen,
    # written into `rows` and dropped once read: these [rows, vocab] temporaries were the sampler's peak (a verify
    # step's, tests/test_verify_memory.py).
    present = counts > 0
    seen = meta.in_prompt.index_select(0, meta.penalty_slots).narrow(1, 0, vocab) | present
    penalty = meta.repetition_penalty[:, None]
    positive = rows > 0
    torch.where(seen & positive, rows / penalty, rows, out=rows)
    torch.where(seen & positive.logical_not_(), rows * penalty, rows, out=rows)
    del seen, positive
    shift = counts.float().mul_(meta.frequency_penalty[:, None])
    del counts
    rows -= shift.add_(present.float().mul_(meta.presence_penalty[:, None]))
    logits.index_copy_(0, meta.penalty_rows, rows)


def filter_top_k_top_p_min_p(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Zero the probabilities each sampled row's top_k / top_p / min_p exclude (the top token always
    survives); one sort over the rows that ask, or when each of them has a top-k of at most half the vocabulary,
    one top-k that wide (nothing past it can survive)."""
    if meta.filter_rows is None:
        return probs
    rows, vocab = probs[meta.filter_rows], probs.shape[1]
    width = meta.filter_width or vocab
    if 2 * width <= vocab:
        sorted_p, order = rows.topk(width, dim=-1)
    elif probs.device.type == "cpu" and 2 * TOP_P_GUESS <= vocab:
        sorted_p, order = _top_p_candidates(rows, meta)
    else:
        sorted_p, order = rows.sort(dim=-1, descending=True)
    kept = torch.zeros_like(rows) if sorted_p.shape[1] < vocab else torch.empty_like(rows)
    keep = torch.arange(sorted_p.shape[1], device=probs.device)[None, :] < meta.top_k[:, None]
    keep &= sorted_p.cumsum(dim=-1) - sorted_p < meta.top_p[:, None]  # the mass strictly above each token
    keep &= sorted_p >= meta.min_p[:, None] * sorted_p[:, :1]
    keep[:, 0] = True
    kept.scatter_(1, order, sorted_p.masked_fill_(keep.logical_not(), 0.0))
    return probs.index_copy_(0, meta.filter_rows, kept)


def _top_p_candidates(rows: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely TOP_P_GUESS tokens of each row when no token past them can survive (their mass reaches the
    row's top_p, or the last of them is under its min_p cut, or its top_k is within them), else the full sort.
    A real model's top-p mass sits in a few hundred tokens: this replaces a sort of the vocabulary per row. On the
    CPU only, where asking the host which case holds costs nothing."""
    sorted_p, order = rows.topk(TOP_P_GUESS, dim=-1)
    # A margin over top_p: the full sort's cumsum adds in another order, and a borderline row is left to it.
    enough = (sorted_p.sum(dim=-1) >= meta.top_p + 1e-4) | (meta.top_k <= TOP_P_GUESS)
    enough |= sorted_p[:, -1] < meta.min_p * sorted_p[:, 0]
    if bool(enough.all()):
        return sorted_p, order
    return rows.sort(dim=-1, descending=True)


def draw_noise(probs: torch.Tensor, meta: SamplingMetadata, default_generator: torch.Generator) -> torch.Tensor:
    """Exp(1) noise for the race over the sampled rows: the engine's generator for the batch, then each
    seeded row's own (so a seeded row's draw never depends on its neighbours)."""
    noise = torch.empty_like(probs)
    _exponential(noise, default_generator)
    for i, gen in enumerate(meta.generators):
        if gen is not None:
            _exponential(noise[i], gen)
    return noise


def _exponential(out: torch.Tensor, generator: torch.Generator) -> None:
    assert generator.device == out.device, \
        f"a generator on {generator.device} cannot draw noise for logits on {out.device}"
    out.exponential_(generator=generator)


def host_argmax_applies(logits: torch.Tensor) -> bool:
    """Whether numpy may take the rows' argmax: plain float32 CPU logits in eager mode, no dispatch mode watching
    (a CPU graph tape, an op count). Its argmax is torch's (the first maximum; a NaN counts as the maximum) and
    ~9x faster than torch's CPU `max`/`argmax` over a dimension: 0.35 against 0.03 ms for 8 rows of a 32k
    vocabulary, 2.7 against 0.26 ms for 64 (BENCHMARKS.md)."""
    return (type(logits) is torch.Tensor and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and not logits.requires_grad and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None)


def sample_on_device(logits: torch.Tensor, meta: SamplingMetadata, default_generator: torch.Generator,
                     chosen_logprobs: bool = True) -> SampledTokens:
    """The rows' tokens and log-probs on the device. Without `chosen_logprobs`, rows that ask no logprobs get
    none (`logprobs` None when no row asks): a logsumexp over the vocabulary per row saved, the larger part of
    a greedy decode step's sampling on the CPU."""
    raw = logits
    edits = meta.bias is not None or meta.masked is not None or meta.bitmask is not None or \
        meta.penalty_rows is not None
    # The working logits: a float32 copy that edits may change, `raw` staying as the model gave it; without edits,
    # float32 logits are read in place (not even a no-op .to(): each dispatched op is a batch-1 step's cost).
    if edits or logits.dtype != torch.float32:
        logits = logits.to(torch.float32, copy=edits)
    if edits:
        apply_bias_and_masks(logits, meta)
        apply_penalties(logits, meta)
    chosen_logits = None  # the chosen tokens' raw logits, when the greedy reduction already gave them
    if host_argmax_applies(logits):  # the CPU's float32 logits: numpy's argmax, the chosen logits later if asked
        chosen = torch.from_numpy(logits.numpy().argmax(axis=-1))
    elif edits or meta.sampled_rows is not None:
        chosen = logits.argmax(dim=-1)
    else:  # greedy over the raw logits: one reduction gives the tokens (first maximum, as argmax) and their logits
        chosen_logits, chosen = logits.max(dim=-1)
    if meta.sampled_rows is not None:
        probs = torch.softmax(logits[meta.sampled_rows] / meta.temperature[:, None], dim=-1)
        del logits  # not needed past here: full-vocabulary temporaries are what the sampler's peak is made of
        probs = filter_top_k_top_p_min_p(probs, meta)
        drawn = (probs / draw_noise(probs, meta, default_generator)).argmax(dim=-1)
        del probs
        chosen.index_copy_(0, meta.sampled_rows, drawn)
    # Log-probs of the model's raw distribution, computed last so they never coexist with the filters' temporaries;
    # the chosen tokens' alone need no [rows, vocab] tensor.
    if raw.dtype != torch.float32:
        raw = raw.float()
    if meta.max_num_logprobs is None:
        if not chosen_logprobs:
            return SampledTokens(chosen, None, None, None, None)
        if chosen_logits is None:
            chosen_logits = raw.gather(1, chosen[:, None])[:, 0]
        token_logprobs = chosen_logits - torch.logsumexp(raw, dim=-1)
        return SampledTokens(chosen, token_logprobs, None, None, None)
    raw_logprobs = torch.log_softmax(raw, dim=-1)
    token_logprobs = raw_logprobs.gather(1, chosen[:, None])[:, 0]
    top = raw_logprobs.topk(max(meta.max_num_logprobs, 1), dim=-1)
    ranks = (raw_logprobs > token_logprobs[:, None]).sum(dim=-1) + 1
    return SampledTokens(chosen, token_logprobs, top.indices, top.values, ranks)


def sample(logits: torch.Tensor, rows: list[SamplingRow] | SamplingMetadata,
           default_generator: torch.Generator) -> SamplerOutput:
    """Sample every row of `logits`; the results on the host."""
    meta = rows if isinstance(rows, SamplingMetadata) else SamplingMetadata.build(rows, logits.shape[1],
                                                                                  logits.device)
    return sample_on_device(logits, meta, default_generator).to_host()


def beam_top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each beam row's top-k next-token log-probs and ids, on the device: all a beam-search step needs."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[1]), dim=-1)
    return top.values, top.indices
