"""Compile the Triton attention variants of the serving path during start-up, not on the first requests.

Triton compiles one kernel per configuration (tile shape, KV split count, stages), and the
configuration follows the batch: decode-only batches and prefill chunks take different tiles, and the
split count grows with the context when the batch is too small to fill the GPU. `kernel_shapes` walks
decode batches of the CUDA-graph ladder and a short prefill chunk at each context length of the
ladder, keeping one shape per distinct configuration; `warm_up_kernels` runs one forward of each over
the real KV cache with every K/V write skipped (slot -1) and the outputs discarded, behind a progress
line. The big prefill variant is compiled by the profiling step before it.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch
from tqdm.auto import tqdm

from engine.layers.attention import AttentionMetadata
from engine.sizing import batch_size_ladder, context_length_ladder

PREFILL_CHUNK = 16  # new tokens of the warm-up prefill: a short prompt, the first request's usual shape
TilesFor = Callable[[int, int, int], Hashable]  # (num_tokens, num_seqs, block-table width in tokens) -> config


def kernel_shapes(max_batch: int, max_model_len: int, block_size: int, tiles_for: TilesFor) -> list[tuple[int, int, int]]:
    """(num_seqs, new tokens per sequence, context length), one per distinct kernel configuration."""
    contexts = context_length_ladder(max_model_len)
    candidates = [(b, 1, c) for b in batch_size_ladder(max_batch) for c in contexts]
    candidates += [(1, PREFILL_CHUNK, c) for c in contexts if c >= PREFILL_CHUNK]
    shapes, seen = [], set()
    for num_seqs, q_len, context in candidates:
        key = tiles_for(num_seqs * q_len, num_seqs, -(-context // block_size) * block_size)
        if key not in seen:
            seen.add(key)
            shapes.append((num_seqs, q_len, context))
    return shapes


def triton_tiles_for(model, device: torch.device) -> TilesFor:
    from kernels.triton_attention import choose_tiles
    attn = model.attention_layers()[0]
    group = attn.num_heads // attn.num_kv_heads
    return lambda tokens, seqs, width: choose_tiles(tokens, seqs, attn.num_kv_heads, group, attn.head_dim, width,
                                                    device)


@torch.inference_mode()
def warm_up_kernels(model, max_batch: int, max_model_len: int, block_size: int, device: torch.device,
                    tiles_for: TilesFor | None = None) -> int:
    """Run one forward per kernel configuration (the KV cache must be bound); returns how many ran."""
    shapes = kernel_shapes(max_batch, max_model_len, block_size, tiles_for or triton_tiles_for(model, device))
    for num_seqs, q_len, context in tqdm(shapes, desc="Compiling Triton kernels", unit="shape"):
        n = num_seqs * q_len
        positions = (torch.arange(q_len, device=device) + context - q_len).repeat(num_seqs)
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros(num_seqs, -(-context // block_size), dtype=torch.int32, device=device),
            seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, n + 1, q_len, dtype=torch.int32, device=device),
            max_query_len=q_len, max_seq_len=context)
        model(torch.zeros(n, dtype=torch.long, device=device), positions, meta)
    return len(shapes)
