"""Feeding tokens to a proposer's model outside the engine step: positions and attention metadata.

A draft model and an MTP head both run their own small forwards over the target's block ids: each sequence is
fed `lens[i]` tokens from position `starts[i]`, into the slots its block table already covers. One function
builds that for both.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.platform.host_copies import to_device
from engine.layers.attention import AttentionMetadata


def feed_metadata(tables: list[list[int]], starts: np.ndarray, lens: np.ndarray, block_size: int,
                  device: torch.device) -> tuple[np.ndarray, AttentionMetadata]:
    """Positions and attention metadata for feeding each sequence `lens[i]` tokens from position `starts[i]`
    (its block table `tables[i]` already covers them)."""
    query_start = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start[1:])
    width = max(len(t) for t in tables)
    table_arr = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        table_arr[i, :len(t)] = t
    owner = np.repeat(np.arange(len(lens)), lens)
    positions = np.arange(int(query_start[-1])) - np.repeat(query_start[:-1] - starts, lens)
    slots = table_arr[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    seq_lens = (starts + lens).astype(np.int32)
    meta = AttentionMetadata(
        slot_mapping=to_device(torch.from_numpy(slots), device),
        block_tables=to_device(torch.from_numpy(table_arr), device),
        seq_lens=to_device(torch.from_numpy(seq_lens), device),
        query_start_loc=to_device(torch.from_numpy(query_start.astype(np.int32)), device),
        max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()))
    return positions, meta
