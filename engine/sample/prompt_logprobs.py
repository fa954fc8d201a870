"""Prompt logprobs: the log-probability the model gives each prompt token after the tokens before it.

A request that asks (`SamplingParams.prompt_logprobs = k`) has logits computed for the prompt positions
of every prefill chunk it runs, not just its last one: position p predicts prompt token p + 1, so a
chunk covering positions [start, end) yields the entries of tokens start + 1 .. min(end, P - 1) + 1 (the
first prompt token never has one). The runner computes those rows in slices of `ROWS_PER_SLICE` so a
long prompt never holds a `[prompt, vocab]` tensor; every tensor-parallel rank computes the same logits
(the LM head gathers across ranks) and rank 0 reduces them to the chosen token's logprob, its rank and
the top k. Such a request never takes cached prefix blocks: their logits were never computed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.sampler import SampledTokens

ROWS_PER_SLICE = 64  # 64 x 152k vocab x fp32 = 39 MB per temporary: inside what KV sizing leaves free


def prompt_positions(seq, start: int, num_new_tokens: int) -> range:
    """Positions of this chunk whose logits give a prompt token's logprob (empty if the request asks none)."""
    if seq.request.params.prompt_logprobs is None:
        return range(0)
    return range(start, min(start + num_new_tokens, seq.num_prompt_tokens - 1))


@dataclass(slots=True)
class PromptLogprobsOutput:
    """Flat over the step's prompt rows, in batch order: chosen logprob, its rank, top-k ids and logprobs."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def compute_prompt_logprobs(hidden: torch.Tensor, rows: list[int], targets: list[int], k: int,
                            compute_logits, reduce: bool) -> PromptLogprobsOutput | None:
    """Logits of `rows` of `hidden`, slice by slice; when `reduce` (rank 0), their log-softmax reduced to the
    logprob and rank of each row's target token and the top `k`. Other ranks only join the LM-head gather."""
    dev = hidden.device
    out = PromptLogprobsOutput([], [], [], [])
    for lo in range(0, len(rows), ROWS_PER_SLICE):
        index = torch.as_tensor(rows[lo:lo + ROWS_PER_SLICE], device=dev)
        logits = compute_logits(hidden[index])
        if not reduce:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target = torch.as_tensor(targets[lo:lo + ROWS_PER_SLICE], device=dev)
        chosen = logprobs.gather(1, target[:, None])[:, 0]
        top = logprobs.topk(max(k, 1), dim=-1)
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        # One device -> host copy per slice (the sampler's packing), not one per result list.
        host = SampledTokens(target, chosen, top.indices[:, :k], top.values[:, :k], ranks).to_host()
        out.logprobs += host.logprobs
        out.ranks += host.ranks
        out.top_ids += host.top_ids
        out.top_logprobs += host.top_logprobs
    return out if reduce else None
