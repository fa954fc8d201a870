"""Starting an engine: the checkpoint resolved and read, the executor started (one ModelRunner, or rank 0 of a
tensor-parallel group and its workers), the KV cache sized from what is left and allocated on every rank, graphs
planned and captured, and the speculative proposer checked before anything loads and built after the target.
A VL model's image side (engine/core/image_inputs.py) is set up before sizing: the KV sizing sets its encoder cache
aside and the profile encodes the largest image the processor accepts. With
--kv-offloading-size each rank then allocates its share of the prefix cache's CPU-RAM tier (engine/planning/offload.py).

The order matters: input rows and a hybrid model's verify scratch are reserved before sizing (the pool is what is
left), a draft model or MTP head loads before sizing (its weights are in the profile and its KV shares the block
ids), and graphs are captured last, over the allocated cache. A failed start shuts every worker down.
"""
from __future__ import annotations

import logging

import torch

from engine.config.flags import EngineConfig
from engine.config.model import ModelConfig
from engine.config.pooler import pooler_for_task
from engine.config.speculative import parse_speculative_config
from engine.core.image_inputs import ImageInputs
from engine.core.started import StartedEngine
from engine.core.tokenizer import load_tokenizer
from engine.executor.tp_executor import create_executor
from engine.kv.kv_cache_interface import model_kv_layout, num_state_snapshots
from engine.planning.kv import verify_scratch_tokens
from engine.planning.offload import HostTierPlan, check_host_tier, plan_host_tier
from engine.planning.units import format_bytes
from engine.platform.devices import kv_storage, resolve_device, resolve_dtype, resolve_kv_cache_dtype
from engine.spec_decode.loading import check_proposer, check_rollback, load_proposer
from engine.worker.graphs.cpu_compile import wanted
from engine.worker.kv_cache_sizing import choose_num_blocks
from engine.worker.loader import resolve_model_path

logger = logging.getLogger("pagedesk.engine")


def start_engine(config: EngineConfig) -> StartedEngine:
    config.validate()
    model_path = resolve_model_path(config.model, config.revision)
    model_config = ModelConfig.from_folder(model_path, config.quantization).with_max_model_len(
        config.max_model_len).with_image_limit(config.image_limit())
    model_config.pooler = pooler_for_task(config.task, model_path, model_config.hf_text_config,
                                          config.speculative_config is not None)
    tokenizer = load_tokenizer(config.tokenizer or model_path, config.trust_remote_code)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, model_config.torch_dtype, device)
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    torch.manual_seed(config.seed)
    spec_config = parse_speculative_config(config.speculative_config)
    proposal = check_proposer(spec_config, config, model_config, model_path, tokenizer)  # before anything loads
    if spec_config is not None:
        check_rollback(model_kv_layout(model_config, config.block_size))
    runner = create_executor(model_config, model_path, device, dtype, config.block_size, backend,
                             config.tensor_parallel_size)
    try:
        max_num_batched_tokens = config.resolve_max_num_batched_tokens(model_config.max_model_len)
        images = ImageInputs(config, model_config, model_path, tokenizer, max_num_batched_tokens)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        runner.reserve_input_rows(config.max_num_seqs)  # before sizing: the pool is what is left
        if spec_config is not None:  # a hybrid model's verify scratch (rollback of rejected drafts)
            runner.reserve_draft_rows(config.max_num_seqs * spec_config.k)  # expert load: drop rejected drafts
            runner.reserve_verify_tokens(verify_scratch_tokens(
                config.max_num_seqs, spec_config.num_speculative_tokens, max_num_batched_tokens))
        if device.type == "cuda" and not config.enforce_eager:
            piecewise_tokens = max_num_batched_tokens if config.cuda_graph_mode == "full_and_piecewise" else 0
            # Their memory (decode graphs, piecewise pieces up to the token budget) is counted in the sizing.
            verify = 1 + spec_config.k if spec_config is not None else 0  # verify steps' rows
            runner.plan_decode_graphs(config.max_num_seqs, True, piecewise_tokens, verify)
        proposer = load_proposer(spec_config, proposal, runner, model_path, backend)
        # A draft model's or MTP head's KV shares the block ids: the budget covers both tensors.
        num_blocks = choose_num_blocks(config, model_config, runner, kv_dtype, max_num_batched_tokens, proposer,
                                       spec_config.k if spec_config is not None else 0, images.max_embeds,
                                       images.largest_image() if device.type == "cuda" else None)
        if proposer is not None:
            proposer.allocate_kv_cache(num_blocks, kv_dtype)
        layout = model_kv_layout(model_config, config.block_size)
        state_slots = config.max_num_seqs if model_config.linear_attention is not None else 0
        snapshots = num_state_snapshots(layout, config.enable_prefix_caching)
        runner.allocate_kv_cache(num_blocks, kv_dtype, state_slots + snapshots)
        host_tier = allocate_host_tier(config, model_config, runner, kv_dtype, dtype)
        runner.capture_decode_graphs()
        if device.type == "cpu":
            runner.set_cpu_linear(config.cpu_linear)
        if device.type == "cpu" and config.cpu_dequant_cache:
            held = runner.keep_dequantized(config.cpu_dequant_cache * 2**30)
            logger.info("--cpu-dequant-cache: %s of float weights beside the quantized blocks", format_bytes(held))
        if device.type == "cpu" and config.tensor_parallel_size == 1 and wanted(config.compile_cpu_forward):
            runner.compile_cpu_forward()  # compiled at the first step of each shape (worker/graphs/cpu_compile.py)
    except BaseException:
        runner.shutdown()  # no worker outlives a failed start
        raise
    return StartedEngine(model_path, model_config, tokenizer, device, dtype, runner, max_num_batched_tokens, layout,
                         num_blocks, state_slots, snapshots, spec_config, proposer, host_tier, images)


def allocate_host_tier(config: EngineConfig, model_config: ModelConfig, runner, kv_dtype: torch.dtype,
                       dtype: torch.dtype) -> HostTierPlan | None:
    """Every rank's share of the CPU-RAM tier (None without --kv-offloading-size), sized from the same layout as
    its device pool's blocks."""
    if not config.kv_offloading_size:
        return None
    tp = config.tensor_parallel_size
    layout = model_kv_layout(model_config, config.block_size, kv_storage(kv_dtype), tp, act_dtype_bytes=dtype.itemsize)
    plan = plan_host_tier(layout, config.kv_offloading_size, tp)
    check_host_tier(plan, config.kv_offloading_size)
    held = runner.allocate_kv_offload(plan.num_blocks, plan.num_state_slots)
    assert held == plan.bytes_per_rank, f"the tier holds {held} bytes per rank, planned {plan.bytes_per_rank}"
    logger.info("%s (%s per rank)", plan.summary(config.block_size), format_bytes(held))
    return plan
