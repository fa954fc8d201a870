"""A step's transient memory: the forward's activations over the step's tokens, the logits rows a step can have,
and the sampler's full-vocabulary temporaries over them.

On CUDA the engine measures this peak with a profiling step (engine/worker/profiling.py), the planner estimates it
here; both take the sampler's rows from `sampler_rows`, so the two count the same step. A step has a logits row
per sampling sequence, and under speculative decoding 1 + k per sequence verifying k drafts, never more rows
than tokens (`max_logits_rows`). Torch-free.
"""
from __future__ import annotations

from engine.config.model import ModelConfig
from engine.planning.vision import tower_peak_over_forward

# The sampler at its widest (fp32 logits, log-softmax, softmax, sorted values, int64 order, cumsum, masks):
# `pagedesk-bench memory` measures 31-35 bytes per logit (peak RSS growth, 16-256 rows; BENCHMARKS.md).
SAMPLER_BYTES_PER_LOGIT = 36
# A verify step's rejection sampler at the same parameters: 30 bytes per logit on CPU, 33 with a draft model's
# q, beside the step's fp32 logits (tests/test_verify_memory.py; its penalty buffers are built per step for the
# verify rows, where the ordinary sampler keeps persistent ones).
VERIFY_BYTES_PER_LOGIT = 40


def max_logits_rows(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int = 0) -> int:
    """The most logits rows one step can have: a row per sampling sequence, 1 + k for each verifying k drafts,
    and no more than the step's tokens (every row is a token of the step)."""
    return min(max_num_batched_tokens, max_num_seqs * (1 + num_speculative_tokens))


def sampler_rows(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int = 0) -> int:
    """Rows the sampler's widest step is profiled and planned at: the step's logits rows, and at least one per
    seat, since the sampling state keeps a row of penalty buffers for every running sequence (engine/sample/
    state.py) even when a step's token budget schedules fewer of them. Without speculation: max_num_seqs."""
    return max(max_num_seqs, max_logits_rows(max_num_seqs, max_num_batched_tokens, num_speculative_tokens))


def sampler_bytes(num_rows: int, vocab_size: int, verify: bool = False) -> int:
    """Peak of sampling `num_rows` rows: float32 logits and the sampler's full-vocabulary temporaries (`verify`:
    the rejection sampler's, over a speculative verify step's rows)."""
    return num_rows * vocab_size * (VERIFY_BYTES_PER_LOGIT if verify else SAMPLER_BYTES_PER_LOGIT)


def forward_activation_bytes(cfg: ModelConfig, num_tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """The forward's transient memory over `num_tokens` tokens on one card (a captured graph's pool too): four
    hidden-sized buffers, the QKV projection's output and three MLP intermediates per token, heads and
    intermediates split across ranks."""
    per_token = (4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
                 + 3 * cfg.intermediate_size // tp) * dtype_bytes
    return num_tokens * per_token


def estimate_activation_bytes(cfg: ModelConfig, num_tokens: int, dtype_bytes: int, tp: int = 1,
                              max_num_seqs: int = 256, num_speculative_tokens: int = 0,
                              max_embeds_per_image: int | None = None) -> int:
    """Peak transient memory of one step over `num_tokens` tokens (the planner's stand-in for profiling): the
    forward's activations plus sampling `sampler_rows` rows over the whole vocabulary (under speculative
    decoding with k drafts, a verify step's 1 + k rows per sequence, as the profile samples them), plus what a VL
    model's tower at the largest image (`max_embeds_per_image` embeddings) needs beyond the forward
    (engine/planning/vision.py)."""
    forward = forward_activation_bytes(cfg, num_tokens, dtype_bytes, tp)
    return forward + sampler_bytes(sampler_rows(max_num_seqs, num_tokens, num_speculative_tokens), cfg.vocab_size,
                                   verify=num_speculative_tokens > 0) + \
        tower_peak_over_forward(cfg, forward, dtype_bytes, max_embeds_per_image)
