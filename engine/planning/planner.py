"""Plans from a model's shape alone: the GUI's capacity planner, the router's placement and the CPU engine.

On CUDA `estimate_profile` is what the engine would measure on one card, built from the quantities of this package
(weights.py, activations.py, graphs.py), and `plan_capacity` runs each card's estimate through the engine's own
`plan_from_profile`; the card with the fewest blocks decides, as in the engine (every rank holds the same blocks).
On CPU the KV budget is explicit (--kv-cache-memory) and `plan_cpu` caps the pool at max_num_seqs full sequences,
for the engine and the planner alike: there is nothing to measure. Speculative decoding's draft model or MTP head
adds its weights on the first card and its KV page at every block id (speculation.py); a hybrid model's verify
scratch sits beside the weights and its state pool comes out of the KV budget (kv.py); a VL model's encoder cache
at its fullest is set aside on every card (vision.py, the rule the engine's sizing applies too). Torch-free.
"""
from __future__ import annotations

import dataclasses

from engine.config.flags import DEFAULT_MAX_IMAGE_PIXELS
from engine.config.model import DTYPE_BYTES, ModelConfig
from engine.kv.kv_cache_interface import model_kv_layout
from engine.planning.activations import estimate_activation_bytes
from engine.planning.capacity import CapacityPlan, MemoryProfile, plan_from_profile
from engine.planning.graphs import estimate_cuda_graph_bytes
from engine.planning.kv import blocks_per_full_seq, state_pool_bytes, verify_scratch_bytes
from engine.planning.speculation import speculation_footprint
from engine.planning.units import GIB, MIB, kv_dtype_bytes
from engine.planning.vision import encoder_cache_bytes, largest_image_embeds
from engine.planning.weights import QUANT_BITS, loaded_bytes_per_card, weights_bytes_per_card

# The CUDA context and cuBLAS workspace: memory outside torch's allocator, which the engine measures (its
# profile's overhead) and the router's placement adds to its estimate; `plan_capacity` leaves it out.
CUDA_CONTEXT_BYTES = 512 * MIB


def estimate_profile(cfg: ModelConfig, total_bytes: int, *, dtype_bytes: int, tensor_parallel_size: int,
                     max_num_batched_tokens: int, max_num_seqs: int, other_programs_bytes: int = 0,
                     quant_bits: int | None = None, cuda_graphs: bool = False, card: str = "",
                     weights_bytes: int | None = None, activation_bytes: int | None = None,
                     cuda_graph_mode: str = "full_and_piecewise", num_speculative_tokens: int = 0,
                     max_embeds_per_image: int | None = None,
                     max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
                     processor_kwargs: dict | None = None) -> MemoryProfile:
    """The planner's MemoryProfile of one card: what the engine would measure, from the model's shape (with
    `cuda_graphs`, the graphs of `cuda_graph_mode`: piecewise pieces count beside the decode graphs; with
    `num_speculative_tokens`, the verify step's 1 + k sampler rows per sequence, as the engine profiles them,
    and the verify steps' graphs, which hybrid models do not capture; a VL model's tower peak and encoder cache
    at its fullest, for images of at most `max_embeds_per_image` embeddings (else the family's published
    default as `processor_kwargs`, --mm-processor-kwargs, resize them) within `max_image_pixels`
    (--max-image-pixels), as the engine caps them: vision.largest_image_embeds)."""
    tp = tensor_parallel_size
    if cfg.vision is not None:
        max_embeds_per_image = largest_image_embeds(cfg.vision, max_image_pixels, max_embeds_per_image,
                                                    processor_kwargs)
    weights = weights_bytes if weights_bytes is not None else loaded_bytes_per_card(cfg, dtype_bytes, tp, quant_bits)
    activations = activation_bytes if activation_bytes is not None else \
        estimate_activation_bytes(cfg, max_num_batched_tokens, dtype_bytes, tp, max_num_seqs, num_speculative_tokens,
                                  max_embeds_per_image)
    graphs = estimate_cuda_graph_bytes(cfg, max_num_seqs, max_num_batched_tokens, dtype_bytes, tp, cuda_graph_mode,
                                       num_speculative_tokens) if cuda_graphs else 0
    return MemoryProfile(card, total_bytes, total_bytes - other_programs_bytes, weights, activations, graphs,
                         encoder_cache_bytes(cfg, max_num_batched_tokens, dtype_bytes, max_embeds_per_image))


def plan_capacity(cfg: ModelConfig, card_bytes: list[int], gpu_memory_utilization: float, *, dtype: str = "bfloat16",
                  kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1, max_model_len: int | None = None,
                  max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, block_size: int = 16,
                  quantization: str | None = None, other_programs_bytes: list[int] | None = None,
                  cuda_graphs: bool = False, weights_bytes: int | None = None,
                  activation_bytes: int | None = None, window_freeing: bool = True,
                  enable_prefix_caching: bool = True, draft: ModelConfig | None = None,
                  num_speculative_tokens: int = 0, mtp: bool = False,
                  cuda_graph_mode: str = "full_and_piecewise",
                  max_embeds_per_image: int | None = None,
                  max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
                  processor_kwargs: dict | None = None) -> CapacityPlan:
    """The planner on CUDA: each card's estimated profile through `plan_from_profile`; the card with the
    fewest blocks decides. `draft`: speculative decoding's draft model, whose weights sit on the first card
    (`weights_bytes`, if given, is the target's alone); `num_speculative_tokens`: k of any speculative method,
    whose verify graphs the CUDA graphs' share counts; `mtp`: speculation by the checkpoint's MTP head, counted
    like a draft on the first card (with its own full embedding and LM head under tensor parallel);
    `max_embeds_per_image`: a VL model's largest image as its folder's processor makes it (the encoder cache's
    size; default: the family's published processor settings as `processor_kwargs`, --mm-processor-kwargs, resize
    them), within `max_image_pixels` (--max-image-pixels)."""
    dtype_bytes = DTYPE_BYTES[dtype]
    kv_bytes = kv_dtype_bytes(kv_cache_dtype, dtype_bytes)
    if max_model_len:
        cfg = dataclasses.replace(cfg, max_model_len=max_model_len)
    tp = tensor_parallel_size
    layout = model_kv_layout(cfg, block_size, kv_bytes, tp, window_freeing, dtype_bytes)
    quant_bits = None if cfg.quantization is not None else QUANT_BITS.get(quantization)  # the folder's own wins
    others = other_programs_bytes or [0] * len(card_bytes)
    draft_weights, draft_per_block = speculation_footprint(cfg, dtype_bytes, kv_bytes, block_size, tp, draft, mtp)
    scratch = verify_scratch_bytes(layout, max_num_seqs, num_speculative_tokens, max_num_batched_tokens)
    plans = []
    for i, (total, other) in enumerate(zip(card_bytes, others)):
        profile = estimate_profile(cfg, total, dtype_bytes=dtype_bytes, tensor_parallel_size=tp,
                                   max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                   other_programs_bytes=other, quant_bits=quant_bits,
                                   cuda_graphs=cuda_graphs, card=f"cuda:{i}" if len(card_bytes) > 1 else "",
                                   weights_bytes=weights_bytes, activation_bytes=activation_bytes,
                                   num_speculative_tokens=num_speculative_tokens, cuda_graph_mode=cuda_graph_mode,
                                   max_embeds_per_image=max_embeds_per_image, max_image_pixels=max_image_pixels,
                                   processor_kwargs=processor_kwargs)
        extra = scratch + (draft_weights if i == 0 else 0)  # the scratch is allocated before sizing; a draft on rank 0
        if extra:
            profile = dataclasses.replace(profile, weights_bytes=profile.weights_bytes + extra)
        plan = plan_from_profile(profile, gpu_memory_utilization, layout.bytes_per_block // block_size, block_size,
                                 cfg.max_model_len, tp, layout, max_num_batched_tokens, max_num_seqs,
                                 enable_prefix_caching, draft_per_block)
        plan.draft_weights_bytes = draft_weights if i == 0 else 0
        plans.append(plan)
    return min(plans, key=lambda p: p.num_blocks)


def plan_cpu(cfg: ModelConfig, kv_cache_gib: float, *, dtype: str = "float32", kv_cache_dtype: str = "auto",
             max_model_len: int | None = None, max_num_seqs: int = 256, block_size: int = 16,
             weights_bytes: int | None = None, max_num_batched_tokens: int = 8192,
             window_freeing: bool = True, enable_prefix_caching: bool = True,
             draft: ModelConfig | None = None, draft_weights_bytes: int | None = None,
             num_speculative_tokens: int = 0, mtp: bool = False,
             draft_kv_bytes_per_block: int | None = None) -> CapacityPlan:
    """The CPU engine's pool: --kv-cache-memory bytes of blocks, capped at max_num_seqs full sequences, shared
    with the KV of a `draft` model or the `mtp` head when speculation uses one (estimated from the config; the
    engine passes what its loaded proposer measures instead: `draft_weights_bytes`, `draft_kv_bytes_per_block`);
    a hybrid model's verify scratch under speculation sits beside the weights, outside the KV budget.
    `weights_bytes` (the engine's measurement), else the parameters' estimate: on CPU the weights are reported,
    not subtracted."""
    dtype_bytes = DTYPE_BYTES[dtype]
    kv_bytes = kv_dtype_bytes(kv_cache_dtype, dtype_bytes)
    max_len = max_model_len or cfg.max_model_len
    budget = int(kv_cache_gib * GIB)
    weights = weights_bytes if weights_bytes is not None else weights_bytes_per_card(cfg, dtype_bytes)
    layout = model_kv_layout(cfg, block_size, kv_bytes, 1, window_freeing, dtype_bytes)
    per_seq = blocks_per_full_seq(layout, max_len, block_size, max_num_batched_tokens)
    states = state_pool_bytes(layout, max_num_seqs, enable_prefix_caching)  # the budget holds a hybrid's states too
    draft_weights, draft_per_block = speculation_footprint(cfg, dtype_bytes, kv_bytes, block_size, 1, draft, mtp)
    if draft_weights_bytes is not None:
        draft_weights = draft_weights_bytes
    if draft_kv_bytes_per_block is not None:
        draft_per_block = draft_kv_bytes_per_block
    scratch = verify_scratch_bytes(layout, max_num_seqs, num_speculative_tokens, max_num_batched_tokens)
    return CapacityPlan(budget, budget, weights + draft_weights + scratch, 0, layout.bytes_per_block // block_size,
                        budget - states, block_size, max_len, 1, card="CPU", max_blocks=max_num_seqs * per_seq,
                        layout=layout, max_num_batched_tokens=max_num_batched_tokens, state_bytes=states,
                        draft_weights_bytes=draft_weights, draft_kv_bytes_per_block=draft_per_block)
