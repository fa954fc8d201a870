"""Sampler: logits of the sampling rows -> next token, its logprob and the top-k logprobs.

Order, as in vLLM: logit bias, min_tokens (EOS and stop ids masked), the grammar bitmask, repetition / presence / frequency
penalties, then temperature, top-k, top-p, min-p, then a draw. The draw is an exponential race
(argmax of p / E with E ~ Exp(1)), which is exactly sampling from p; a seeded request draws its noise
from its own generator, so its output never depends on what else is in the batch. Logprobs are those of
the model's raw distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output.bitmask import apply_token_bitmask


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    eos_ids: list[int]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # of the chosen token
    top_ids: list[list[int]] | None  # per row, the top-k ids by logprob (k = max requested)
    top_logprobs: list[list[float]] | None
    ranks: list[int] | None  # rank of the chosen token


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long,
                                device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
            ids = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device).index_add_(
                0, ids, torch.ones(len(ids), device=logits.device))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def apply_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
        if len(row.output_ids) < p.min_tokens:
            banned = ([] if p.ignore_eos else row.eos_ids) + p.stop_token_ids
            if banned:
                logits[i, banned] = float("-inf")


def filter_top_k_top_p_min_p(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Zero the probabilities each row's top_k / top_p / min_p exclude (the top token always survives)."""
    for i, row in enumerate(rows):
        p = row.params
        if p.top_k == -1 and p.top_p >= 1.0 and p.min_p <= 0.0:
            continue
        prob = probs[i]
        sorted_p, order = prob.sort(descending=True)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if p.top_k > 0:
            keep[p.top_k:] = False
        if p.top_p < 1.0:
            before = sorted_p.cumsum(0) - sorted_p  # mass strictly above each token
            keep &= before < p.top_p
        if p.min_p > 0.0:
            keep &= sorted_p >= p.min_p * sorted_p[0]
        keep[0] = True
        prob[order[~keep]] = 0.0
    return probs


def sample(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator,
           bitmask: torch.Tensor | None = None) -> SamplerOutput:
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = logits.clone()
    apply_masks(logits, rows)
    if bitmask is not None:  # structured outputs: only tokens the row's grammar allows
        apply_token_bitmask(logits, bitmask)
    apply_penalties(logits, rows)
    greedy = [r.params.greedy for r in rows]
    chosen = logits.argmax(dim=-1)
    if not all(greedy):
        temps = torch.tensor([1.0 if g else r.params.temperature for g, r in zip(greedy, rows)],
                             device=logits.device)
        probs = filter_top_k_top_p_min_p(torch.softmax(logits / temps[:, None], dim=-1), rows)
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            if not greedy[i]:
                noise[i].exponential_(generator=row.generator or default_generator)
        drawn = (probs / noise).argmax(dim=-1)
        chosen = torch.where(torch.tensor(greedy, device=logits.device), chosen, drawn)
    token_logprobs = raw_logprobs.gather(1, chosen[:, None])[:, 0]
    out = SamplerOutput(chosen.tolist(), token_logprobs.tolist(), None, None, None)
    k = max((r.params.logprobs or 0) for r in rows)
    if any(r.params.logprobs is not None for r in rows):
        top = raw_logprobs.topk(max(k, 1), dim=-1)
        out.top_ids, out.top_logprobs = top.indices.tolist(), top.values.tolist()
        out.ranks = ((raw_logprobs > token_logprobs[:, None]).sum(dim=-1) + 1).tolist()
    return out
