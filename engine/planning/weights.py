"""What a model's weights take on each card: the layer matrices split across ranks (packed as the folder's
quantization_config says, or at a planner's guessed bit width; a GGUF file's tensors at their stored size),
embeddings and LM head vocab-split, norms and routers replicated, and the float32 RoPE tables beside them (`loaded_bytes_per_card`: what a card holds after
loading, which the engine measures on CUDA and the planner, the router and the CPU plan estimate here).
Torch-free: the GUI's planner imports it.
"""
from __future__ import annotations

from engine.config.model import ModelConfig
from engine.planning.vision import vision_weights_bytes
from engine.quantization.config import QuantConfig

# A planner's guess of the bit width from a --quantization name alone (a folder's quantization_config wins).
QUANT_BITS = {None: None, "awq": 4, "gptq": 4, "int4": 4, "compressed-tensors": 4, "fp8": 8}


def packed_matrix_bytes(matrix_params: int, quant: QuantConfig) -> int:
    """Bytes of `matrix_params` weights as the engine keeps them in memory: codes, plus per group a scale and a
    zero point in the dtypes engine/quantization/methods.py gives them (AWQ/GPTQ/AutoRound float16 scales,
    compressed-tensors float32; a byte per 4-bit zero point, int16 for 8-bit, symmetric or not, since the
    kernels read one), MXFP4's one E8M0 byte per 32, or block-wise FP8's float32 scale per output row and
    block (methods.expand_block_scales). Per-channel scales and g_idx are one number per row: left out."""
    codes = matrix_params * quant.bits // 8
    if quant.group_size == -1:
        return codes
    if quant.weight_type == "float":  # block-wise FP8: a float32 scale per output row and block of columns
        return codes + matrix_params // quant.group_size * 4
    if quant.weight_type == "mxfp4":
        return codes + matrix_params // quant.group_size
    scale_bytes = 4 if quant.method == "compressed-tensors" else 2
    zero_bytes = 1 if quant.bits <= 4 else 2
    return codes + matrix_params // quant.group_size * (scale_bytes + zero_bytes)


ATTENTION_SINKS = ("GptOssForCausalLM",)


GGUF_FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def gguf_bytes_per_card(quant: QuantConfig, dtype_bytes: int, tp: int = 1) -> int:
    """A GGUF model on one of `tp` cards: every quantized tensor as the file stores it (the engine keeps the
    blocks: linears, experts, embedding and LM head), float tensors (norms, routers, an F16 file's matrices) in the
    engine's dtype, all split across ranks (norms and routers, replicated, are a rounding error here)."""
    quantized = sum(n for t, n in quant.gguf_bytes if t not in GGUF_FLOAT_BYTES)
    float_params = sum(n // GGUF_FLOAT_BYTES[t] for t, n in quant.gguf_bytes if t in GGUF_FLOAT_BYTES)
    return -(-(quantized + float_params * dtype_bytes) // tp)


def weights_bytes_per_card(cfg: ModelConfig, dtype_bytes: int, tp: int = 1, quant_bits: int | None = None) -> int:
    """Layer matrices split across ranks — packed as the folder's quantization_config says, or at `quant_bits`
    with a 16-bit scale per 128 weights (a planner's guess from a method name); embeddings and LM head
    vocab-split in `dtype`; QKV biases split; norms replicated; a VL model's tower and projector whole on every
    card, in `dtype` (engine/planning/vision.py). A GGUF file: its own tensor bytes (text only: its header
    names no tower)."""
    if cfg.quantization is not None and cfg.quantization.method == "gguf":
        return gguf_bytes_per_card(cfg.quantization, dtype_bytes, tp)
    h = cfg.hidden_size
    attention_params, attention_vectors = cfg.attention_params(tp)  # per-layer shapes (Gemma 4's differ)
    linear = cfg.linear_attention  # Gated DeltaNet layers: heads (and their conv channels) split across ranks
    if linear is not None:
        attention_params += len(linear.layers) * linear.matrix_params(h) // tp
    mlp_params, _, router_params = cfg.mlp_params()  # every expert is in memory, split by its intermediate dim
    matrix_params = attention_params + mlp_params // tp
    vector_params = (cfg.norms_per_layer * cfg.num_layers + 1) * h + router_params  # RMSNorm weights and routers, replicated
    vector_params += attention_vectors  # QKV biases split, q/k norms replicated
    num_attention = len(cfg.attention_layer_ids)
    if cfg.o_bias:  # o_proj's bias, kept whole
        vector_params += num_attention * h
    if cfg.architecture in ATTENTION_SINKS:  # one learned sink logit per head, split by head
        vector_params += num_attention * cfg.num_heads // tp
    if linear is not None:
        vector_params += len(linear.layers) * linear.vector_params() // tp
    ple_embedding, ple_rest = cfg.per_layer_input_params()  # Gemma 4: float, embedding vocab-split
    vector_params += ple_rest + -(-ple_embedding // tp)
    if quant_bits is not None:
        matrix_bytes = matrix_params * quant_bits // 8 + matrix_params // 128 * dtype_bytes
    elif cfg.quantization is not None:
        # Checkpoints that keep attention in float (gpt-oss's MXFP4 quantizes only the experts) say so by name.
        float_attention = cfg.quantization.is_ignored("model.layers.0.self_attn.q_proj")
        quantized = matrix_params - attention_params if float_attention else matrix_params
        matrix_bytes = packed_matrix_bytes(quantized, cfg.quantization) + (matrix_params - quantized) * dtype_bytes
    else:
        matrix_bytes = matrix_params * dtype_bytes
    embed_rows = -(-cfg.vocab_size // tp)
    embed_bytes = embed_rows * h * dtype_bytes * (1 if cfg.tie_word_embeddings else 2)
    return matrix_bytes + embed_bytes + vector_params * dtype_bytes + vision_weights_bytes(cfg, dtype_bytes)


def rope_table_bytes(cfg: ModelConfig) -> int:
    """The float32 cos/sin tables (engine/layers/rotary.py): one [max_position_embeddings, rotary dims] table per
    distinct RoPE parameter set (Gemma 3: local and global), shared by every layer that uses it."""
    types = cfg.layer_types or ["full_attention"] * cfg.num_layers
    distinct = {}
    for layer_type, p in cfg.rope_parameters.items():
        d = cfg.layer_head_dim(types.index(layer_type)) if layer_type in types else cfg.head_dim
        rotary = d if p.get("rope_type") == "proportional" else int(d * p.get("partial_rotary_factor", 1.0))
        distinct[repr((d, sorted(p.items())))] = rotary
    return sum(cfg.max_position_embeddings * rotary * 4 for rotary in (distinct or {"": cfg.head_dim}).values())


def loaded_bytes_per_card(cfg: ModelConfig, dtype_bytes: int, tp: int = 1, quant_bits: int | None = None) -> int:
    """What one card holds after loading: its share of the weights and the RoPE tables (whole on every card)."""
    return weights_bytes_per_card(cfg, dtype_bytes, tp, quant_bits) + rope_table_bytes(cfg)
