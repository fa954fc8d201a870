"""The dummy step the KV sizing measures: the largest prefill batch the scheduler can form, and sampling.

`profile_batch` lays `max_num_batched_tokens` dummy tokens out as prefill sequences of at most
max_model_len tokens each (at most max_num_seqs of them), with block tables over a temporary cache just
big enough for them, so the profiling forward runs the real attention path (K/V writes and the attention
kernel with their workspaces) rather than skipping it. `profile_sampling_batch` is the sampler's widest
step: `sampler_rows` rows (engine/planning/activations.py, which the planner counts too: max_num_seqs, since
every sequence of every request counts against it at admission) with every full-vocabulary temporary on
(penalties, top-k/top-p, logprobs, and a grammar bitmask on every row, whose unpacking makes [rows, vocab]
int32 temporaries). Under speculative decoding (k drafts) the widest step is a verify step instead:
`sampler_rows` counts 1 + k logits rows per sequence, and `profile_verify_batch` sends them all through the
rejection sampler with the same parameters, a draft model's q on every draft row. The runner samples either
through the same `sample` a real step uses (engine/worker/sampling.py), while the forward's hidden states and
logits are still alive, as they are in a real step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.layers.attention import AttentionMetadata
from engine.planning.activations import sampler_rows
from engine.sample.metadata import SamplingBatch, SamplingRow, make_generator
from engine.sample.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.spec_decode.speculator import SpecBatch
from engine.structured_output.bitmask import allocate_bitmask
from engine.worker.sampling import sample


@dataclass(slots=True)
class ProfileBatch:
    input_ids: np.ndarray  # [num_tokens] int64, all zero
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    num_blocks: int  # blocks the temporary KV cache needs
    num_sampler_rows: int  # logits rows the step samples at the sampler's widest (the last tokens')

    def metadata(self, device: torch.device) -> AttentionMetadata:
        query_start = np.concatenate([[0], np.cumsum(self.seq_lens)]).astype(np.int32)
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(self.slot_mapping).to(device),
            block_tables=torch.from_numpy(self.block_tables).to(device),
            seq_lens=torch.from_numpy(self.seq_lens).to(device),
            query_start_loc=torch.from_numpy(query_start).to(device),
            max_query_len=int(self.seq_lens.max()), max_seq_len=int(self.seq_lens.max()))


def profile_batch(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                  num_speculative_tokens: int = 0) -> ProfileBatch:
    """Prefills that fill the token budget: as few sequences as max_model_len allows, each on its own blocks,
    sampled at `sampler_rows` (counted on the budget asked for, as the planner counts it: 1 + k rows per
    sequence under speculative decoding)."""
    rows = sampler_rows(max_num_seqs, num_tokens, num_speculative_tokens)
    num_tokens = min(num_tokens, max_num_seqs * max_model_len)
    num_seqs = -(-num_tokens // max_model_len)
    seq_lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int32)
    seq_lens[:num_tokens % num_seqs] += 1
    blocks_per_seq = -(-seq_lens // block_size)
    first_block = np.concatenate([[0], np.cumsum(blocks_per_seq)[:-1]])
    tables = np.zeros((num_seqs, int(blocks_per_seq.max())), dtype=np.int32)
    positions, slots = [], []
    for i, n in enumerate(seq_lens):
        tables[i, :blocks_per_seq[i]] = first_block[i] + np.arange(blocks_per_seq[i])
        pos = np.arange(n, dtype=np.int64)
        positions.append(pos)
        slots.append(first_block[i] * block_size + pos)  # the sequence's blocks are consecutive
    return ProfileBatch(np.zeros(num_tokens, dtype=np.int64), np.concatenate(positions), np.concatenate(slots),
                        tables, seq_lens, int(blocks_per_seq.sum()), rows)


def profile_sampling_batch(num_rows: int, vocab_size: int, device: torch.device) -> SamplingBatch:
    """`num_rows` sampling rows at the sampler's widest (temperature, top-k/top-p, penalties, logprobs and a
    grammar bitmask: every full-vocabulary temporary it makes), one per logits row."""
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.1,
                            logprobs=MAX_LOGPROBS)
    batch = SamplingBatch(generator=make_generator(0, device))
    batch.rows = [SamplingRow(params, [0, 0], 1, None, []) for _ in range(num_rows)]
    batch.logits_index = list(range(num_rows))
    batch.bitmask = allocate_bitmask(num_rows, vocab_size)  # all allowed: the cost is the unpacking, not the mask
    return batch


def profile_verify_batch(num_rows: int, num_speculative_tokens: int, vocab_size: int,
                         device: torch.device) -> SamplingBatch:
    """A verify step of `num_rows` logits rows at the widest: sequences of 1 + k rows (the last one shorter when
    the rows run out), each row with profile_sampling_batch's parameters and bitmask, and a draft model's q
    [drafts, vocab] on the device (n-gram and MTP drafts carry none; the profile counts the widest method)."""
    batch = profile_sampling_batch(num_rows, vocab_size, device)
    spec = SpecBatch()
    spec.rows, spec.logits_index, spec.bitmask = batch.rows, batch.logits_index, batch.bitmask
    for start in range(0, num_rows, 1 + num_speculative_tokens):
        spec.draft_token_ids.append([0] * (min(num_rows - start, 1 + num_speculative_tokens) - 1))
    num_drafts = sum(map(len, spec.draft_token_ids))
    spec.draft_probs = torch.full((num_drafts, vocab_size), 1.0 / vocab_size, dtype=torch.float32, device=device)
    spec.q_index = list(range(num_drafts))
    return SamplingBatch(generator=batch.generator, spec=spec)


def profile_sampler(num_seqs: int, vocab_size: int, device: torch.device) -> None:
    """The sampler's widest step alone, over random logits (the memory bench, device-placement tests)."""
    logits = torch.randn(num_seqs, vocab_size, dtype=torch.float32, device=device)
    sample(logits, profile_sampling_batch(num_seqs, vocab_size, device))
