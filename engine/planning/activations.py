"""A step's transient memory: the forward's activations over the step's tokens and the sampler's full-vocabulary
temporaries over its logits rows. On CUDA the engine measures this peak with a profiling step
(engine/worker/profiling.py); the planner estimates it here. Torch-free.
"""
from __future__ import annotations

from engine.config.model import ModelConfig

# The sampler at its widest (fp32 logits, log-softmax, softmax, sorted values, int64 order, cumsum, masks):
# `pagedesk-bench memory` measures 31-35 bytes per logit (peak RSS growth, 16-256 rows; BENCHMARKS.md).
SAMPLER_BYTES_PER_LOGIT = 36


def sampler_bytes(num_rows: int, vocab_size: int) -> int:
    """Peak of sampling `num_rows` rows: float32 logits and the sampler's full-vocabulary temporaries."""
    return num_rows * vocab_size * SAMPLER_BYTES_PER_LOGIT


def forward_activation_bytes(cfg: ModelConfig, num_tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """The forward's transient memory over `num_tokens` tokens on one card (a captured graph's pool too): four
    hidden-sized buffers, the QKV projection's output and three MLP intermediates per token, heads and
    intermediates split across ranks."""
    per_token = (4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
                 + 3 * cfg.intermediate_size // tp) * dtype_bytes
    return num_tokens * per_token


def estimate_activation_bytes(cfg: ModelConfig, num_tokens: int, dtype_bytes: int, tp: int = 1,
                              max_num_seqs: int = 256) -> int:
    """Peak transient memory of one step over `num_tokens` tokens (the planner's stand-in for profiling): the
    forward's activations plus sampling min(num_tokens, max_num_seqs) rows over the whole vocabulary."""
    return forward_activation_bytes(cfg, num_tokens, dtype_bytes, tp) + \
        sampler_bytes(min(num_tokens, max_num_seqs), cfg.vocab_size)
