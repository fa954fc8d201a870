"""The pooling path: embedding requests through the same engine, prompt-only, pooled instead of sampled.

A request with `PoolingParams` never samples (`ScheduledSeq.samples` is False for it, so no logits are
computed); each step the runner sums the final normed hidden states of the rows `pooling_spans` picks for it
(last-token: the prompt's last row, once the chunk reaching it runs; CLS: row 0; mean: every row of every
chunk) and hands the small [num_pooled, hidden] float32 result to the host. `RequestPooling` keeps a mean's
running sum across chunked-prefill steps (restarted by a chunk at position 0, so a preempted and recomputed
prompt counts once) and, when the prompt is complete, makes the embedding: mean divided by the prompt length,
truncated to `dimensions` (Matryoshka) and then L2-normalised where the model normalises. Under tensor
parallel every rank holds the same hidden states; only rank 0 pools. An embedding engine drops the LM head
(`drop_lm_head`) and reads checkpoints saved from the bare model (Qwen3-Embedding's `layers.*` without
`model.`) through `embedding_weights`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from engine.config.pooler import PoolerConfig

NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's, as sentence-transformers' Normalize uses


@dataclass(slots=True)
class PoolingParams:
    """vLLM's name. `dimensions`: Matryoshka truncation; `normalize` None: the model's own choice."""

    dimensions: int | None = None
    normalize: bool | None = None


@dataclass(slots=True)
class RequestPooling:
    """One embedding request's pooling: its parameters, the model's pooler, the running sum over chunks."""

    params: PoolingParams
    pooler: PoolerConfig
    total: torch.Tensor | None = None  # [hidden] float32 on the host
    embedding: list[float] | None = None  # set once the prompt is complete

    @property
    def needs_every_token(self) -> bool:
        return self.pooler.needs_every_token

    def add(self, start: int, values: torch.Tensor) -> None:
        """A step's pooled sum of the rows it computed, its chunk starting at prompt position `start`."""
        self.total = values.clone() if start == 0 or self.total is None else self.total + values

    def finish(self, num_prompt_tokens: int) -> list[float]:
        vector = self.total / num_prompt_tokens if self.pooler.pooling_type == "MEAN" else self.total
        if self.params.dimensions is not None:
            vector = vector[:self.params.dimensions]
        normalize = self.pooler.normalize if self.params.normalize is None else self.params.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=0, eps=NORMALIZE_EPS)
        self.embedding = vector.tolist()
        self.total = None
        return self.embedding


@dataclass(slots=True)
class PooledOutput:
    """One step's pooled rows (rank 0): `owners[i]` is the batch index of the sequence `values[i]` is for."""

    owners: list[int] = field(default_factory=list)
    values: torch.Tensor | None = None  # [len(owners), hidden] float32 on the host


def pool_span(pooling: RequestPooling, start: int, num_new: int, num_prompt: int) -> tuple[int, int] | None:
    """The chunk-relative rows [a, b) a pooling sequence's chunk at `start` contributes, or None."""
    kind = pooling.pooler.pooling_type
    if kind == "LAST":
        return (num_new - 1, num_new) if start + num_new == num_prompt else None
    if kind == "CLS":
        return (0, 1) if start == 0 else None
    return 0, num_new


def pooling_spans(batch, computed, query_start) -> tuple[list[int], list[tuple[int, int]]]:
    """Per pooling sequence of a scheduled batch that contributes this step: its batch index and token rows."""
    owners, spans = [], []
    for i, item in enumerate(batch):
        pooling = item.seq.request.pooling
        if pooling is None:
            continue
        span = pool_span(pooling, int(computed[i]), item.num_new_tokens, item.seq.num_prompt_tokens)
        if span is not None:
            owners.append(i)
            spans.append((int(query_start[i]) + span[0], int(query_start[i]) + span[1]))
    return owners, spans


def pool_hidden(hidden: torch.Tensor, owners: list[int], spans: list[tuple[int, int]]) -> PooledOutput:
    """Sum each span's rows of the final hidden states in float32 on the device; one copy to the host."""
    rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(hidden.device)
    segment = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor([b - a for a, b in spans]))
    out = torch.zeros((len(spans), hidden.shape[-1]), dtype=torch.float32, device=hidden.device)
    out.index_add_(0, segment.to(hidden.device), hidden[rows].float())
    return PooledOutput(list(owners), out.cpu())


def record_pooled(scheduled, pooled: PooledOutput | None) -> list:
    """Add a step's pooled rows to their requests; returns the sequences whose embedding is now complete (a
    CLS-pooled prompt completes in a chunk that pooled nothing)."""
    rows = dict(zip(pooled.owners, range(len(pooled.owners)))) if pooled is not None else {}
    complete = []
    for i, item in enumerate(scheduled):
        seq = item.seq
        pooling = seq.request.pooling
        if pooling is None:
            continue
        if i in rows:
            pooling.add(seq.num_computed_tokens if pooling.needs_every_token else 0, pooled.values[rows[i]])
        if seq.num_computed_tokens + item.num_new_tokens == seq.num_prompt_tokens:
            pooling.finish(seq.num_prompt_tokens)
            complete.append(seq)
    return complete


def drop_lm_head(model: torch.nn.Module) -> None:
    """An embedding engine never computes logits: no LM head weights are held (nor loaded)."""
    if isinstance(getattr(model, "lm_head", None), torch.nn.Module):
        del model.lm_head


def embedding_weights(weights: Iterable[tuple[str, torch.Tensor]], model: torch.nn.Module
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors for an embedding engine: `lm_head.*` dropped, and a checkpoint saved from the
    bare decoder (`layers.0...`, `embed_tokens...`, `norm...`) read under the family's `model.` prefix."""
    prefixed = {name.split(".", 2)[1] for name, _ in model.named_parameters() if name.startswith("model.")}
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        if name.split(".", 1)[0] in prefixed:
            name = "model." + name
        yield name, tensor
