"""The chunk table of the Triton chunked gated delta rule (kernels/triton_gated_delta.py), made on the host.

A prefill row of more than one token is cut into CHUNK-token chunks; the kernels need, per chunk, its sequence and
its first token, and the list of sequences that have chunks. `chunk_arrays` builds them from the step's query
offsets as the host already holds them (a numpy array or a list: no device read); the engine makes them device
tensors once per step (`ChunkTable`, in the step's attention metadata), so each Gated DeltaNet layer of the step
reuses them instead of reading query_start_loc back from the card (36 host syncs a step for Qwen3-Next's 36
DeltaNet layers). Imports nothing of ours.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

CHUNK = 16  # tokens per chunk; the result does not depend on it beyond float32 rounding


@dataclass(slots=True)
class ChunkTable:
    chunk_seq: torch.Tensor  # [num_chunks] int32: the sequence of each chunk
    chunk_first: torch.Tensor  # [num_chunks] int32: its first token row
    long_seqs: torch.Tensor  # [num_long] int32: the sequences of more than one token, in order


def chunk_arrays(query_start_loc) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chunk_seq, chunk_first, long_seqs) int32 for a batch cut by `query_start_loc` (host values)."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    lengths = np.diff(starts)
    long_seqs = np.flatnonzero(lengths > 1)
    per_seq = -(-lengths[long_seqs] // CHUNK)
    chunk_seq = np.repeat(long_seqs, per_seq)
    offsets = np.arange(len(chunk_seq)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    chunk_first = starts[chunk_seq] + offsets * CHUNK
    return chunk_seq.astype(np.int32), chunk_first.astype(np.int32), long_seqs.astype(np.int32)
