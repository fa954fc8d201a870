"""CUDA-graph memory before capture: which decode graphs are captured (batch sizes × context lengths), the
piecewise graphs' token buckets, speculative verify graphs (1 + k tokens a row), and what each set is estimated
to hold.

The model runner sizes the KV pool around these estimates (`graph_bytes` before capture; measured once captured)
and the planner and the router count the same (`estimate_cuda_graph_bytes`). The ladders are the capture's own:
engine/worker/graphs/decode.py captures `batch_size_ladder` × `context_length_ladder`, and the piecewise bucket
spacing is mirrored here because this module stays torch-free.
"""
from __future__ import annotations

from engine.config.model import ModelConfig
from engine.kv.kv_cache_interface import model_kv_layout
from engine.planning.activations import forward_activation_bytes
from engine.planning.units import MIB

GRAPH_OVERHEAD_BYTES = 2 * MIB  # per captured graph: kernel parameters and bookkeeping (an estimate)
SPLIT_CONTEXT_LENGTHS = (512, 1024, 2048, 4096, 8192)  # where the decode kernel's split count can change
PIECE_OVERHEAD_BYTES = 64 * 1024  # per captured piece: a few layers' kernel nodes (an estimate)
PIECEWISE_MIN_BUCKET = 16  # engine/worker/graphs/piecewise.py's spacing of token buckets, mirrored
# Speculative verify graphs (1 + k tokens per row) are captured up to this batch: speculation pays at small
# batches (BENCHMARKS.md), and each verify batch holds 1 + k times the tokens of a decode batch.
VERIFY_GRAPH_MAX_BATCH = 64


def batch_size_ladder(max_batch: int) -> list[int]:
    """Decode batch sizes captured as CUDA graphs: 1, 2, 4, 8, then every 16 up to max_batch (vLLM's spacing)."""
    ladder = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 16, 16))
    return sorted({min(b, max_batch) for b in ladder})


def context_length_ladder(max_model_len: int) -> list[int]:
    """Context lengths the captured decode graphs are specialised for: the attention kernel picks its KV
    split count from the block-table width, so a graph captured only at max_model_len would split short
    contexts as if they were long."""
    return [c for c in SPLIT_CONTEXT_LENGTHS if c < max_model_len] + [max_model_len]


def estimate_graph_bytes(cfg: ModelConfig, max_num_seqs: int, dtype_bytes: int, tp: int = 1,
                         query_len: int = 1) -> int:
    """Decode graphs' memory before capture: the largest batch's activations (the graphs share one pool) plus
    bookkeeping per graph, counting every (batch size, context length) pair that may be captured;
    `query_len` > 1: speculative verify graphs, each row 1 + k tokens."""
    ladder = batch_size_ladder(max_num_seqs)
    num_graphs = len(ladder) * len(context_length_ladder(cfg.max_model_len))
    return forward_activation_bytes(cfg, max(ladder) * query_len, dtype_bytes, tp) + GRAPH_OVERHEAD_BYTES * num_graphs


def piecewise_bucket_count(max_tokens: int, min_bucket: int = PIECEWISE_MIN_BUCKET) -> int:
    """How many token buckets engine/worker/graphs/piecewise.py's token_buckets captures (the same spacing)."""
    count, size = 0, min_bucket
    while size < max_tokens:
        count += 1
        size += min_bucket if size < 4 * min_bucket else (1 << (size.bit_length() - 1)) // 4
    return count + 1


def estimate_piecewise_graph_bytes(cfg: ModelConfig, max_tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """Piecewise graphs' memory before capture: one forward's activations at the largest bucket (every bucket's
    pieces share one pool, captured largest first) plus bookkeeping per piece (one per layer and one more, per
    bucket). The eager points' outputs are allocated inside the pieces, so they are part of the activations."""
    pieces = piecewise_bucket_count(max_tokens) * (cfg.num_layers + 1)
    return forward_activation_bytes(cfg, max_tokens, dtype_bytes, tp) + PIECE_OVERHEAD_BYTES * pieces


def estimate_verify_graph_bytes(cfg: ModelConfig, max_num_seqs: int, dtype_bytes: int, tp: int,
                                num_speculative_tokens: int) -> int:
    """Speculative verify steps' graphs, (batch, 1 + k) up to VERIFY_GRAPH_MAX_BATCH rows; none without
    speculation, and none for hybrid models (which verify through the piecewise graphs)."""
    if not num_speculative_tokens or getattr(cfg, "linear_attention", None) is not None:
        return 0
    return estimate_graph_bytes(cfg, min(max_num_seqs, VERIFY_GRAPH_MAX_BATCH), dtype_bytes, tp,
                                1 + num_speculative_tokens)


def estimate_cuda_graph_bytes(cfg: ModelConfig, max_num_seqs: int, max_num_batched_tokens: int, dtype_bytes: int,
                              tp: int = 1, cuda_graph_mode: str = "full_and_piecewise",
                              num_speculative_tokens: int = 0) -> int:
    """Every CUDA graph the engine captures for --cuda-graph-mode, before capture (what the model runner's
    `graph_bytes` estimates): the decode graphs, with "full_and_piecewise" the piecewise pieces up to the step
    budget too, for a hybrid model the decode graphs' padding state slot beside the pool, and under speculation
    (`num_speculative_tokens` k) the verify steps' graphs."""
    if cuda_graph_mode not in ("full_and_piecewise", "full_decode_only"):
        raise ValueError(f"cuda_graph_mode {cuda_graph_mode!r}: choose full_and_piecewise or full_decode_only")
    total = estimate_graph_bytes(cfg, max_num_seqs, dtype_bytes, tp)
    if cuda_graph_mode == "full_and_piecewise":
        total += estimate_piecewise_graph_bytes(cfg, max_num_batched_tokens, dtype_bytes, tp)
    total += model_kv_layout(cfg, 16, dtype_bytes, tp, act_dtype_bytes=dtype_bytes).state_bytes_per_seq
    return total + estimate_verify_graph_bytes(cfg, max_num_seqs, dtype_bytes, tp, num_speculative_tokens)
