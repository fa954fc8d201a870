"""Compile the Triton attention variants of the serving path during start-up, not on the first requests.

Triton compiles one kernel per configuration (tile shape, KV split count, stages), and the
configuration follows the batch: decode-only batches and prefill chunks take different tiles, and the
split count grows with the context when the batch is too small to fill the GPU; the quantized linears'
row tile follows the token count (kernels/triton_quant_linear.py `choose_quant_kernel`). `kernel_shapes`
walks decode batches of the CUDA-graph ladder and short prefill chunks at each context length of the
ladder, keeping one shape per distinct configuration; `warm_up_kernels` runs one forward of each over
the real KV cache with every K/V write skipped (slot -1) and the outputs discarded, behind a progress
line. The big prefill variant is compiled by the profiling step before it.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch
from tqdm.auto import tqdm

from engine.layers.attention import AttentionMetadata
from engine.planning.graphs import batch_size_ladder, context_length_ladder

# New tokens of the warm-up prefills: a short prompt (the first request's usual shape), and the widest row tile
# of the quantized GEMV (GEMV_MAX_ROWS), which the decode ladder misses when max_num_seqs is below it.
PREFILL_CHUNKS = (16, 32)
# Past this many new tokens a prefill's programs fill any card (132 SMs x 64-row tiles, one KV head): no split.
MAX_SPLIT_CHUNK = 8192
TilesFor = Callable[[int, int, int], Hashable]  # (num_tokens, num_seqs, block-table width in tokens) -> config


def kernel_shapes(max_batch: int, max_model_len: int, block_size: int, tiles_for: TilesFor,
                  every_size: bool = False) -> list[tuple[int, int, int]]:
    """(num_seqs, new tokens per sequence, context length), one per distinct kernel configuration.

    `every_size` also walks every decode batch up to max_batch and every prefill chunk up to each context
    (plus a one-block context, below the first split length): eager steps take any size, and the split count
    follows the size, so the ladder alone misses variants (the key function is cheap; only distinct keys run)."""
    contexts = context_length_ladder(max_model_len)
    candidates = [(b, 1, c) for b in batch_size_ladder(max_batch) for c in contexts]
    candidates += [(1, q, c) for q in PREFILL_CHUNKS for c in contexts if c >= q]
    if every_size:
        contexts = [block_size] + contexts
        candidates += [(b, 1, c) for b in range(1, max_batch + 1) for c in contexts]
        candidates += [(1, q, c) for c in contexts for q in range(2, min(c, MAX_SPLIT_CHUNK) + 1)]
    shapes, seen = [], set()
    for num_seqs, q_len, context in candidates:
        key = tiles_for(num_seqs * q_len, num_seqs, -(-context // block_size) * block_size)
        if key not in seen:
            seen.add(key)
            shapes.append((num_seqs, q_len, context))
    return shapes


def triton_tiles_for(model, device: torch.device, facts: list[tuple[int, int]] | None = None) -> TilesFor:
    """The configuration key of a forward's Triton kernels. `facts`: every tensor-parallel rank's (SM count,
    compute capability major) (engine/worker/graphs/dispatch.rank_facts): the key is then the attention tiles
    each of those cards would choose, the same on every rank whatever its own card."""
    from kernels.triton_attention import choose_tiles
    from kernels.triton_quant_linear import choose_quant_kernel
    attn = model.attention_layers()[0]
    group = attn.num_heads // attn.num_kv_heads
    cards = sorted(set(facts)) if facts else [None]
    # The quantized linears' choice is part of the key even for a float model: a few more warm-up forwards,
    # and no guessing here which layers are quantized.
    return lambda tokens, seqs, width: (*(choose_tiles(tokens, seqs, attn.num_kv_heads, group, attn.head_dim, width,
                                                       device, facts=card) for card in cards),
                                        choose_quant_kernel(tokens))


@torch.inference_mode()
def warm_up_kernels(model, max_batch: int, max_model_len: int, block_size: int, device: torch.device,
                    tiles_for: TilesFor | None = None, every_size: bool | None = None) -> int:
    """Run one forward per kernel configuration (the KV cache must be bound); returns how many ran. With the
    real key (no `tiles_for`, or `every_size`: tensor parallel's rank-identical key), every batch and chunk size
    is walked; with another key only the ladder's, and other sizes compile on first use."""
    shapes = kernel_shapes(max_batch, max_model_len, block_size, tiles_for or triton_tiles_for(model, device),
                           every_size=tiles_for is None if every_size is None else every_size)
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
