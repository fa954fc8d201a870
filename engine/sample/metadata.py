"""Per-step sampling inputs, host side: what the engine asks the model runner to draw.

`SamplingBatch` is the engine's request to the model runner for one step: one `SamplingRow` per token to
draw (with the logits row it reads, so the n outputs of a request fork off one row) and the logits rows of
beam-search sequences, whose top log-probs are returned instead of a draw. The same as tensors on the logits'
device is `SamplingMetadata` (engine/sample/state.py). Seeded generators are made by `make_generator`, on the
device they serve.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sample.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on `device` (a CUDA generator for CUDA logits: a CPU one there is an error in torch)."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far: the sequence's own list, not copied (sliced only for penalties)
    num_prompt_tokens: int
    generator: torch.Generator | None  # a seeded request's own; None: the engine's generator
    eos_ids: list[int]
    key: int | None = None  # the sequence's id: its sampling state persists across steps (None: one step)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class SamplingBatch:
    """What to draw this step: `rows[i]` samples from logits row `logits_index[i]`."""

    rows: list[SamplingRow] = field(default_factory=list)
    logits_index: list[int] = field(default_factory=list)
    beam_index: list[int] = field(default_factory=list)  # logits rows of beam-search sequences
    beam_topk: int = 0  # how many top log-probs each beam row needs (2 x beam width)
    generator: torch.Generator | None = None  # the engine's, on the logits' device: unseeded rows draw from it
    bitmask: torch.Tensor | None = None  # structured outputs: packed int32 [len(rows), ceil(vocab / 32)], host side
    spec: object | None = None  # speculative verify rows (engine/spec_decode/speculator.SpecBatch), or None
    # The chosen token's logprob of rows that ask no logprobs too (tools and tests read it); the engine reports
    # cumulative_logprob only where logprobs were asked (vLLM v1) and turns this off: no logsumexp per step.
    chosen_logprobs: bool = True
