"""Beam search over shared KV blocks: each step forks the surviving beams off their parents by reference.

Scoring follows HF transformers' `generate(num_beams=k, do_sample=False, early_stopping=True)`: from
all beams' cumulative log-probs take the top 2k continuations; those ending in EOS (or at max_tokens)
among the first k become finished hypotheses scored sum_logprob / generated_len ** length_penalty; the
best k unfinished continue. Search ends when k hypotheses are finished (early stopping) or at
max_tokens. Each live beam reports only its top 2k next-token log-probs (computed on the device by the
model runner): any of the global top 2k continuations is among its own beam's top 2k, so the search
needs no more, and works on small host tensors. A beam's K/V is never copied: children share the parent's
blocks through ref counts, and only a shared, partly filled last block is copied when written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

NEG_INF = -1.0e9


def length_normalized(score: float, length: int, length_penalty: float) -> float:
    """score / length ** length_penalty (HF's ranking, computed the same way); a huge finite penalty saturates
    (towards 0 or -inf) instead of raising OverflowError or dividing by zero."""
    try:
        return score / max(1, length) ** length_penalty
    except OverflowError:  # length ** penalty past the float range: the quotient is 0
        return score * 0.0
    except ZeroDivisionError:  # length ** penalty underflowed to 0
        return 0.0 if score == 0.0 else math.copysign(math.inf, score)


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= 16:
            raise ValueError(f"beam_width must be between 1 and 16, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    text: str  # generated text
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty


@dataclass
class BeamSearchOutput:
    request_id: str
    prompt: str | None
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class Candidate:
    parent: int  # index into the live beams
    token: int
    score: float  # cumulative logprob


@dataclass
class BeamGroup:
    """The search state of one request; the engine feeds it each live beam's next-token log-probs."""

    params: BeamSearchParams
    eos_ids: list[int]
    num_prompt_tokens: int
    scores: list[float] = field(default_factory=lambda: [0.0])  # cumulative logprob per live beam
    # live beam index -> (its top next-token log-probs, their token ids), at least 2k of them, best first
    pending: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict)
    finished: list[tuple[float, list[int], float]] = field(default_factory=list)  # (score, tokens, cum)
    done: bool = False

    def ready(self) -> bool:
        return len(self.pending) == len(self.scores)

    def advance(self, beam_tokens: list[list[int]]) -> list[Candidate]:
        """One search step given every live beam's tokens; returns the beams to continue (may be none)."""
        k, lp = self.params.beam_width, self.params.length_penalty
        generated = len(beam_tokens[0]) - self.num_prompt_tokens
        beams = [self.pending[i] for i in range(len(self.scores))]
        self.pending.clear()
        width = min(len(lp) for lp, _ in beams)
        logprobs = torch.tensor([lp[:width] for lp, _ in beams]) + torch.tensor(self.scores)[:, None]
        top = logprobs.flatten().topk(min(2 * k, logprobs.numel()))
        candidates = [Candidate(i // width, beams[i // width][1][i % width], s)
                      for s, i in zip(top.values.tolist(), top.indices.tolist())]
        at_max = generated + 1 >= self.params.max_tokens
        hits = [at_max or (not self.params.ignore_eos and c.token in self.eos_ids) for c in candidates]
        accepting = len(self.finished) < k  # early_stopping=True: k hypotheses end the search
        for rank, (c, hit) in enumerate(zip(candidates, hits)):
            if hit and rank < k and accepting:
                tokens = beam_tokens[c.parent] + [c.token]
                self.finished.append((length_normalized(c.score, generated + 1, lp), tokens, c.score))
        self.finished = sorted(self.finished, key=lambda f: -f[0])[:k]
        running = [c for c, hit in zip(candidates, hits) if not hit][:k]
        self.scores = [c.score for c in running]
        self.done = not running or len(self.finished) == k
        return [] if self.done else running

    def results(self, decode) -> list[BeamSearchSequence]:
        n = self.num_prompt_tokens
        return [BeamSearchSequence(tokens, decode(tokens[n:]), cum, score) for score, tokens, cum in self.finished]
