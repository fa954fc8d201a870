"""Capacity arithmetic: weights per card, KV bytes per token, and how many tokens fit the KV budget.

Torch-free so the GUI's capacity planner and the engine's KV sizing use the same numbers. The model is
given as a ModelConfig (read from config.json). The planner estimates weights and activations
(`plan_capacity`); the engine measures them on every card after loading and a profiling forward
(`MemoryProfile`) and plans each card with `plan_from_profile` — the same formula:

    usable   = min(total × gpu_memory_utilization, free memory at start)
    KV bytes = usable − weights − peak activations − overhead (CUDA graphs, NCCL buffers)
    blocks   = KV bytes // (KV bytes per token per card × block_size)
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import DTYPE_BYTES, ModelConfig
from engine.quantization.config import QuantConfig

GIB = 1024 ** 3
QUANT_BITS = {None: None, "awq": 4, "gptq": 4, "int4": 4, "compressed-tensors": 4, "fp8": 8}


def packed_matrix_bytes(matrix_params: int, quant: QuantConfig) -> int:
    """Bytes of `matrix_params` weights as the checkpoint packs them: codes, plus per group a 16-bit scale and
    (asymmetric int) a packed zero point. Per-channel scales and g_idx are one number per row: left out."""
    codes = matrix_params * quant.bits // 8
    if quant.group_size == -1:
        return codes
    zero_bits = 0 if quant.symmetric or quant.weight_type == "float" else quant.bits
    return codes + matrix_params // quant.group_size * (16 + zero_bits) // 8


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype_bytes: int, tp: int = 1) -> int:
    """K and V bytes of one token on one card: KV heads are split across ranks, replicated below one each."""
    kv_heads = max(1, cfg.num_kv_heads // tp)
    return 2 * cfg.num_layers * kv_heads * cfg.head_dim * kv_dtype_bytes


def weights_bytes_per_card(cfg: ModelConfig, dtype_bytes: int, tp: int = 1, quant_bits: int | None = None) -> int:
    """Layer matrices split across ranks — packed as the folder's quantization_config says, or at `quant_bits`
    with a 16-bit scale per 128 weights (a planner's guess from a method name); embeddings and LM head
    vocab-split in `dtype`; QKV biases split; norms replicated."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, max(1, cfg.num_kv_heads // tp) * tp * cfg.head_dim
    matrix_params = cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size) // tp
    vector_params = (2 * cfg.num_layers + 1) * h  # RMSNorm weights, replicated
    if cfg.qkv_bias:
        vector_params += cfg.num_layers * (q + 2 * kv) // tp
    if cfg.qk_norm:
        vector_params += cfg.num_layers * 2 * cfg.head_dim
    if quant_bits is not None:
        matrix_bytes = matrix_params * quant_bits // 8 + matrix_params // 128 * dtype_bytes
    elif cfg.quantization is not None:
        matrix_bytes = packed_matrix_bytes(matrix_params, cfg.quantization)
    else:
        matrix_bytes = matrix_params * dtype_bytes
    embed_rows = -(-cfg.vocab_size // tp)
    embed_bytes = embed_rows * h * dtype_bytes * (1 if cfg.tie_word_embeddings else 2)
    return matrix_bytes + embed_bytes + vector_params * dtype_bytes


def estimate_activation_bytes(cfg: ModelConfig, num_tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """Peak transient memory of one forward over `num_tokens` tokens (the planner's stand-in for profiling)."""
    per_token = (4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
                 + 3 * cfg.intermediate_size // tp) * dtype_bytes
    logits = min(num_tokens, 256) * cfg.vocab_size * 4
    return num_tokens * per_token + logits


@dataclass
class CapacityPlan:
    card_bytes: int  # total memory of the smallest card
    usable_bytes: int  # card_bytes * gpu_memory_utilization, capped by the free memory at start if measured
    weights_bytes: int  # per card
    activation_bytes: int  # per card
    kv_bytes_per_token: int  # per card
    kv_budget_bytes: int  # per card
    block_size: int
    max_model_len: int
    tensor_parallel_size: int
    overhead_bytes: int = 0  # measured: CUDA graphs and memory outside torch's allocator (NCCL buffers)
    other_programs_bytes: int = 0  # measured: held by the desktop and other processes when the engine started
    card: str = ""  # which card this plan is for, e.g. "cuda:1 (NVIDIA GeForce RTX 3090)"

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
        where = f" on {self.card}" if self.card else ""
        usable = f"{self.card_bytes / GIB:.2f} GiB × gpu_memory_utilization"
        if self.other_programs_bytes:
            usable += f", capped by the {self.other_programs_bytes / GIB:.2f} GiB other programs hold"
        overhead = f" − CUDA graphs/NCCL {self.overhead_bytes / GIB:.2f} GiB" if self.overhead_bytes else ""
        if self.weights_bytes >= self.usable_bytes:
            levers = ("The weights alone need more than the usable memory: raise --tensor-parallel-size (more cards) "
                      "or pick a smaller or 4-bit model")
        elif self.num_tokens:
            levers = (f"Lower --max-model-len to {self.num_tokens:,} or less, raise --gpu-memory-utilization, use "
                      "--kv-cache-dtype fp8, or raise --tensor-parallel-size")
        else:
            levers = ("Lower --max-num-batched-tokens (activations), raise --gpu-memory-utilization, or raise "
                      "--tensor-parallel-size")
        return (f"not even one {self.max_model_len:,}-token sequence fits{where}: {self.usable_bytes / GIB:.2f} GiB "
                f"usable per card ({usable}) − weights {self.weights_bytes / GIB:.2f} GiB − activations "
                f"{self.activation_bytes / GIB:.2f} GiB{overhead} leaves {max(0, self.kv_budget_bytes) / GIB:.2f} GiB "
                f"for the KV cache; at {self.kv_bytes_per_token / 1024:.1f} KiB/token that holds "
                f"{self.num_tokens:,} tokens. {levers}")


@dataclass(frozen=True)
class MemoryProfile:
    """What one rank measured on its card: at start, after loading its shard, and at the profiling peak."""

    card: str  # e.g. "cuda:1 (NVIDIA GeForce RTX 3090)"
    total_bytes: int
    free_bytes_at_start: int  # before the engine loaded anything (the desktop holds the rest)
    weights_bytes: int
    activation_bytes: int  # peak of the profiling forward above what was allocated before it
    overhead_bytes: int  # CUDA graphs and memory allocated outside torch's allocator (NCCL)


def plan_from_profile(p: MemoryProfile, gpu_memory_utilization: float, kv_bytes_per_token: int, block_size: int,
                      max_model_len: int, tensor_parallel_size: int) -> CapacityPlan:
    wanted = int(p.total_bytes * gpu_memory_utilization)
    usable = min(wanted, p.free_bytes_at_start)
    others = p.total_bytes - p.free_bytes_at_start if usable < wanted else 0
    budget = usable - p.weights_bytes - p.activation_bytes - p.overhead_bytes
    return CapacityPlan(p.total_bytes, usable, p.weights_bytes, p.activation_bytes, kv_bytes_per_token, budget,
                        block_size, max_model_len, tensor_parallel_size, p.overhead_bytes, others, p.card)


def free_memory_shortfall(p: MemoryProfile, gpu_memory_utilization: float) -> str | None:
    """A plain sentence when the card had less free memory at start than the requested fraction."""
    wanted = p.total_bytes * gpu_memory_utilization
    if p.free_bytes_at_start >= wanted:
        return None
    fits = int(p.free_bytes_at_start / p.total_bytes * 100) / 100
    return (f"{p.card}: only {p.free_bytes_at_start / GIB:.2f} GiB of {p.total_bytes / GIB:.2f} GiB was free at "
            f"start, below --gpu-memory-utilization {gpu_memory_utilization:.2f} ({wanted / GIB:.2f} GiB); other "
            f"programs (the desktop, other processes) hold {(p.total_bytes - p.free_bytes_at_start) / GIB:.2f} GiB, "
            f"so the engine uses {p.free_bytes_at_start / GIB:.2f} GiB. Close them, or set "
            f"--gpu-memory-utilization {fits:.2f} or lower to plan for it")


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
        weights_bytes_per_card(cfg, dtype_bytes, tp, QUANT_BITS.get(quantization) if cfg.quantization is None else None)
    activations = activation_bytes if activation_bytes is not None else \
        estimate_activation_bytes(cfg, max_num_batched_tokens, dtype_bytes, tp)
    return CapacityPlan(card, usable, weights, activations, kv_bytes_per_token(cfg, kv_bytes, tp),
                        usable - weights - activations, block_size, max_model_len or cfg.max_model_len, tp)
