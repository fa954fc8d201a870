"""Per-step sampling inputs: what the engine asks for (host side) and the same as batch tensors on the device.

`SamplingBatch` is the engine's request to the model runner for one step: one `SamplingRow` per token to
draw (with the logits row it reads, so the n outputs of a request fork off one row) and the logits rows of
beam-search sequences, whose top log-probs are returned instead of a draw. `SamplingMetadata` is the same
as tensors on the logits' device (temperatures, filters, penalty buffers, flat bias/mask indices), made by
the model runner's persistent `SamplingState` (engine/sampling_state.py) from what changed since the last
step, or by `SamplingMetadata.build` from the rows alone; the sampler never loops over the vocabulary in
Python and never mixes host and device tensors; on a card every copy is asynchronous from pinned memory, so
the model runner builds it before the forward and the host never waits for the card. Seeded generators are
made by `make_generator`, on the device they serve.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.input_batch import to_device
from engine.sampling_params import SamplingParams


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


@dataclass
class SamplingMetadata:
    """One step's sampling parameters as device tensors. Work is done only on the rows that ask for it:
    `sampled_rows` (not greedy), `filter_rows` (of those, the ones with top-k/top-p/min-p; an index into
    the sampled rows) and `penalty_rows`; each parameter tensor is laid out over its subset. None: no row asks."""

    num_rows: int
    sampled_rows: torch.Tensor | None  # long [S]: rows that draw (None: all greedy)
    temperature: torch.Tensor | None  # [S]
    generators: list[torch.Generator | None]  # [S]: a seeded row's own; None: the engine's
    filter_rows: torch.Tensor | None  # long [F], positions within the sampled rows
    top_k: torch.Tensor | None  # long [F], vocab size where off
    top_p: torch.Tensor | None  # [F], 2.0 where off: the mass above a token never reaches it
    min_p: torch.Tensor | None  # [F], 0.0 where off
    penalty_rows: torch.Tensor | None  # long [P]
    repetition_penalty: torch.Tensor | None  # [P]
    presence_penalty: torch.Tensor | None  # [P]
    frequency_penalty: torch.Tensor | None  # [P]
    # The sampling state's persistent penalty buffers (engine/sampling_state.py), read at the rows' slots
    # only when the penalties are applied (no [P, vocab] gather alive during the forward).
    penalty_slots: torch.Tensor | None  # long [P]
    in_prompt: torch.Tensor | None  # bool [slots, vocab]: the token is in the slot's prompt
    output_counts: torch.Tensor | None  # int32 [slots, vocab]: times the token is in the slot's output
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values) of logit_bias
    masked: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf (min_tokens)
    max_num_logprobs: int | None  # top-k width for logprobs; None: no row asks
    # Structured outputs: packed allowed-token bits [num_rows, ceil(vocab / 32)] int32 (bit j of word w
    # allows token 32 w + j; all ones for rows without a grammar), applied right after logit bias/min_tokens.
    bitmask: torch.Tensor | None = None

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingMetadata":
        """From the rows alone, nothing kept: a throwaway SamplingState (the same code as a step's)."""
        from engine.sampling_state import SamplingState
        return SamplingState(vocab_size, device, len(rows)).metadata(rows)


def bias_tensors(rows: list[SamplingRow], device: torch.device):
    entries = [(i, t, v) for i, r in enumerate(rows) for t, v in (r.params.logit_bias or {}).items()]
    if not entries:
        return None
    i, t, v = zip(*entries)
    return (to_device(torch.tensor(i), device), to_device(torch.tensor(t), device),
            to_device(torch.tensor(v, dtype=torch.float32), device))


def masked_tensors(rows: list[SamplingRow], device: torch.device):
    """Token ids a row may not draw this step: EOS and stop ids before min_tokens, and the last token of each
    bad word whose other tokens the output ends with (a one-token bad word always)."""
    entries = []
    for i, r in enumerate(rows):
        p = r.params
        if r.num_output_tokens < p.min_tokens:
            entries += [(i, t) for t in ([] if p.ignore_eos else r.eos_ids) + p.stop_token_ids]
        for word in p.bad_words_token_ids:
            head = len(word) - 1
            if head == 0 or (r.num_output_tokens >= head and r.token_ids[len(r.token_ids) - head:] == word[:-1]):
                entries.append((i, word[-1]))
    if not entries:
        return None
    i, t = zip(*entries)
    return to_device(torch.tensor(i), device), to_device(torch.tensor(t), device)
