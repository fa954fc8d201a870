"""What speculative decoding adds to rank 0's card: a draft model's weights and KV page per block id, or an MTP head's
(for the families engine/models/registry.py declares one for: the planner's estimate of what they load).

Both run whole on rank 0 (engine/spec_decode/loading.py), in the target's dtypes, and their caches are addressed by
the target's block ids, so their pages share the KV budget in proportion (engine/planning/kv.py's
`blocks_with_draft`). N-gram speculation adds nothing here; every method's verify rows and graphs are counted
where those quantities are (activations.py, graphs.py, kv.py's verify scratch). Torch-free.
"""
from __future__ import annotations

import dataclasses

from engine.config.model import ModelConfig
from engine.kv.kv_cache_interface import model_kv_layout
from engine.models.registry import mtp_head
from engine.planning.kv import kv_bytes_per_block
from engine.planning.weights import loaded_bytes_per_card


def draft_footprint(draft: ModelConfig | None, dtype_bytes: int, kv_dtype_bytes: int,
                    block_size: int) -> tuple[int, int]:
    """A draft model's (weights bytes, KV bytes per block): whole on rank 0's card, in the target's dtypes;
    (0, 0) without a draft."""
    if draft is None:
        return 0, 0
    return loaded_bytes_per_card(draft, dtype_bytes), \
        kv_bytes_per_block(draft, block_size, kv_dtype_bytes, act_dtype_bytes=dtype_bytes)


def mtp_footprint(cfg: ModelConfig, dtype_bytes: int, kv_dtype_bytes: int, block_size: int,
                  tensor_parallel_size: int = 1) -> tuple[int, int]:
    """The MTP head's (weights bytes, KV bytes per block) on rank 0; a ValueError naming speculative_config.method
    when the family declares no head (engine/models/registry.mtp_head, the engine's own check). The planner's
    estimate of what engine/models/qwen3_next_mtp.py (Qwen3.5/3.6, Qwen3-Next) loads: per MTP layer one
    full-attention decoder layer (the target's attention shape, layer 0's MLP or experts) and its KV page, plus
    `mtp.fc` (2h -> h) and three norms, all in the float dtype (published checkpoints keep mtp.* unquantized).
    With one rank the embedding and LM head are the target's; under tensor parallel the head runs whole on rank 0
    with its own full copies of them (2 × vocab × hidden, one copy when tied), since the target's are vocab
    shards."""
    mtp_head(cfg.architecture)
    text = cfg.hf_text_config
    layers = int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers")) or 1)
    h = cfg.hidden_size
    full = dataclasses.replace(cfg, layer_types=["full_attention"] * cfg.num_layers, quantization=None)
    attention = full.attention_params(1)[0] // cfg.num_layers
    if cfg.moe is not None and 0 in cfg.moe.moe_layers:  # layer 0's MLP kind: every expert and the router
        experts, _, router = cfg.moe.layer_params(h)
        mlp = experts + router
    else:
        mlp = 3 * h * cfg.layer_intermediate_size(0)
    per_layer = attention + mlp + 2 * h * h + 4 * h
    page = model_kv_layout(full, block_size, kv_dtype_bytes, 1, True, dtype_bytes).groups[0].spec.page_size_bytes
    vocab = 0 if tensor_parallel_size == 1 else (1 if cfg.tie_word_embeddings else 2) * cfg.vocab_size * h
    return (layers * per_layer + vocab) * dtype_bytes, layers * page


def speculation_footprint(cfg: ModelConfig, dtype_bytes: int, kv_dtype_bytes: int, block_size: int,
                          tensor_parallel_size: int = 1, draft: ModelConfig | None = None,
                          mtp: bool = False) -> tuple[int, int]:
    """(weights bytes, KV bytes per block) that speculation adds on rank 0: the MTP head's with `mtp`, else the
    `draft` model's; (0, 0) for n-gram or no speculation."""
    if mtp:
        return mtp_footprint(cfg, dtype_bytes, kv_dtype_bytes, block_size, tensor_parallel_size)
    return draft_footprint(draft, dtype_bytes, kv_dtype_bytes, block_size)
