"""Capacity arithmetic: weights per card, KV bytes per token, and how many tokens fit the KV budget.

Torch-free so the GUI's capacity planner and the engine's KV sizing use the same numbers. The model is
given as a ModelConfig (read from config.json); activation memory is measured by the engine's profiling
pass and estimated here when no measurement exists (the planner).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import DTYPE_BYTES, ModelConfig

GIB = 1024 ** 3
QUANT_BITS = {None: None, "awq": 4, "gptq": 4, "int4": 4}


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype_bytes: int, tp: int = 1) -> int:
    """K and V bytes of one token on one card: KV heads are split across ranks, replicated below one each."""
    kv_heads = max(1, cfg.num_kv_heads // tp)
    return 2 * cfg.num_layers * kv_heads * cfg.head_dim * kv_dtype_bytes


def weights_bytes_per_card(cfg: ModelConfig, dtype_bytes: int, tp: int = 1, quant_bits: int | None = None) -> int:
    """Layer matrices split across ranks (4-bit when quantized, with a scale per 128 weights); embeddings
    vocab-split; norms replicated."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, max(1, cfg.num_kv_heads // tp) * tp * cfg.head_dim
    matrix_params = cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size) // tp
    matrix_bytes = matrix_params * dtype_bytes if quant_bits is None else \
        matrix_params * quant_bits // 8 + matrix_params // 128 * dtype_bytes
    embed_rows = -(-cfg.vocab_size // tp)
    embed_bytes = embed_rows * h * dtype_bytes * (1 if cfg.tie_word_embeddings else 2)
    norm_bytes = (2 * cfg.num_layers + 1) * h * dtype_bytes
    return matrix_bytes + embed_bytes + norm_bytes


def estimate_activation_bytes(cfg: ModelConfig, num_tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """Peak transient memory of one forward over `num_tokens` tokens (the planner's stand-in for profiling)."""
    per_token = (4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
                 + 3 * cfg.intermediate_size // tp) * dtype_bytes
    logits = min(num_tokens, 256) * cfg.vocab_size * 4
    return num_tokens * per_token + logits


@dataclass
class CapacityPlan:
    card_bytes: int  # total memory of the smallest card
    usable_bytes: int  # card_bytes * gpu_memory_utilization
    weights_bytes: int  # per card
    activation_bytes: int  # per card
    kv_bytes_per_token: int  # per card
    kv_budget_bytes: int  # per card
    block_size: int
    max_model_len: int
    tensor_parallel_size: int

    @property
    def num_blocks(self) -> int:
        return max(0, self.kv_budget_bytes // (self.kv_bytes_per_token * self.block_size))

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_full_seqs(self) -> int:
        return self.num_tokens // self.max_model_len

    @property
    def fits(self) -> bool:
        return self.num_full_seqs >= 1

    def summary(self) -> str:
        return (f"weights {self.weights_bytes / GIB:.2f} GiB/card · KV {self.kv_bytes_per_token / 1024:.1f} KiB/token"
                f" · {self.num_tokens:,} tokens fit · {self.num_full_seqs} × {self.max_model_len:,}-token sequences")

    def explain_misfit(self) -> str:
        return (f"not even one {self.max_model_len}-token sequence fits: {self.usable_bytes / GIB:.2f} GiB usable "
                f"per card ({self.card_bytes / GIB:.2f} GiB × gpu_memory_utilization) − weights "
                f"{self.weights_bytes / GIB:.2f} GiB − activations {self.activation_bytes / GIB:.2f} GiB leaves "
                f"{max(0, self.kv_budget_bytes) / GIB:.2f} GiB for the KV cache at "
                f"{self.kv_bytes_per_token / 1024:.1f} KiB/token = {self.num_tokens:,} tokens. Lower --max-model-len "
                f"(to {max(self.num_tokens // 2 ** 10 * 2 ** 10, 0):,} or less), raise --gpu-memory-utilization, use "
                "--kv-cache-dtype fp8, or raise --tensor-parallel-size")


def plan_capacity(cfg: ModelConfig, card_bytes: list[int], gpu_memory_utilization: float, *, dtype: str = "bfloat16",
                  kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1, max_model_len: int | None = None,
                  max_num_batched_tokens: int = 8192, block_size: int = 16, quantization: str | None = None,
                  weights_bytes: int | None = None, activation_bytes: int | None = None) -> CapacityPlan:
    """How the smallest card's share of memory splits into weights, activations and KV cache."""
    tp = tensor_parallel_size
    dtype_bytes = DTYPE_BYTES[dtype]
    kv_bytes = dtype_bytes if kv_cache_dtype == "auto" else DTYPE_BYTES[kv_cache_dtype]
    card = min(card_bytes)
    usable = int(card * gpu_memory_utilization)
    weights = weights_bytes if weights_bytes is not None else \
        weights_bytes_per_card(cfg, dtype_bytes, tp, QUANT_BITS.get(quantization))
    activations = activation_bytes if activation_bytes is not None else \
        estimate_activation_bytes(cfg, max_num_batched_tokens, dtype_bytes, tp)
    return CapacityPlan(card, usable, weights, activations, kv_bytes_per_token(cfg, kv_bytes, tp),
                        usable - weights - activations, block_size, max_model_len or cfg.max_model_len, tp)
