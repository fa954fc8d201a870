"""Hybrid linear attention end to end: Qwen3-Next, Qwen3.5 (text and its VL checkpoint on text prompts) and
Qwen3.5-MoE, greedy token ids identical to HF transformers on tiny random models whose layers alternate Gated
DeltaNet (a per-sequence conv + recurrent state in the state pool) and gated full attention.

Each is served plainly (twice: the second time from the prefix cache), and with 32-token chunks over a tiny
pool, so chunk boundaries fall inside prompts (each chunk continues the state the previous one left), prefill
chunks share steps with decodes, and preemption drops states that are then recomputed. A greedy request with n=2 checks the fork's state copy
(both outputs must be HF's); a seeded n=3 request gives the same outputs alone and inside a batch; beam search
matches HF num_beams. With the prefix cache a hit restores the state snapshot kept at its last block (a
shared system prompt reports cached tokens), and after every run only the snapshots hold state slots.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.beam_search import BeamSearchParams
from hf_reference import HYBRID_MAX_TOKENS as MAX_TOKENS, hf_greedy
from tiny_models import HYBRID_ARCHS, HYBRID_VL_ARCHS, hf_model

pytestmark = pytest.mark.timeout(300)
ALL_ARCHS = list(HYBRID_ARCHS) + list(HYBRID_VL_ARCHS)


def greedy(llm: LLM, prompts, n: int = 1):
    params = [SamplingParams(temperature=0, max_tokens=m, n=n) for m in MAX_TOKENS[:len(prompts)]]
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_no_state_held(llm: LLM) -> None:
    """Only the prefix cache's state snapshots hold slots once the work is done; every block is free."""
    kv = llm.engine.kv
    assert kv.state.pool.held() == set(kv.snapshots.values()) and not kv.pending_state_copies
    assert len(kv.snapshots) <= kv.num_snapshot_slots
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_hybrid_family_matches_hf_plain_chunked_and_preempted(hybrid_reference, arch):
    path, prompts, expected = hybrid_reference(arch)
    llm = LLM(str(path), device="cpu")
    assert [outs[0] for outs in greedy(llm, prompts)] == expected
    assert [outs[0] for outs in greedy(llm, prompts)] == expected  # again: hits restore state snapshots
    assert llm.engine.kv.prefix_hits > 0
    assert_no_state_held(llm)
    if arch in HYBRID_VL_ARCHS:  # the same decoder as qwen3_5 behind another weights mapper: plain is enough
        return
    tiny = LLM(str(path), device="cpu", max_num_batched_tokens=32, num_gpu_blocks_override=10, max_num_seqs=4)
    assert [outs[0] for outs in greedy(tiny, prompts)] == expected
    assert tiny.engine.scheduler.num_preemptions > 0
    assert_no_state_held(tiny)


def test_forks_copy_the_state(hybrid_reference):
    """Greedy n=2: the second output forks off the first after the prompt, from a copy of its state slot, so
    both must be HF's continuation (a child reading a stale or shared slot would drift)."""
    path, prompts, expected = hybrid_reference("qwen3_5")
    llm = LLM(str(path), device="cpu", max_num_seqs=8)
    assert greedy(llm, prompts, n=2) == [[e, e] for e in expected]
    assert_no_state_held(llm)


def test_seeded_n_is_the_same_alone_and_in_a_batch(hybrid_reference):
    path, prompts, _ = hybrid_reference("qwen3_next")
    llm = LLM(str(path), device="cpu", max_num_seqs=8, max_num_batched_tokens=32)
    seeded = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    alone = [c.token_ids for c in llm.generate([prompts[2]], [seeded], use_tqdm=False)[0].outputs]
    others = [SamplingParams(temperature=0.8, seed=i, max_tokens=6) for i in range(3)]
    batch = llm.generate([prompts[0], prompts[2], prompts[3], prompts[1]], [others[0], seeded, others[1], others[2]],
                         use_tqdm=False)
    assert [c.token_ids for c in batch[1].outputs] == alone
    assert len({tuple(t) for t in alone}) > 1  # the outputs really sample apart
    assert_no_state_held(llm)


def test_beam_search_matches_hf(hybrid_reference):
    """Each beam step forks the surviving beams: their states are copied (or handed over by a parent that
    ends), never shared."""
    path, prompts, _ = hybrid_reference("qwen3_5")
    hf = hf_model(path)
    llm = LLM(str(path), device="cpu", max_num_seqs=4)
    for prompt in (prompts[0], prompts[2]):
        want = hf.generate(torch.tensor([prompt]), num_beams=3, do_sample=False, length_penalty=1.0,
                           early_stopping=True, max_new_tokens=8,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        while want and want[-1] == hf.generation_config.pad_token_id:
            want.pop()
        got = llm.beam_search([prompt], BeamSearchParams(3, 8), use_tqdm=False)[0].sequences[0]
        assert got.tokens[len(prompt):] == want
    assert_no_state_held(llm)


def test_mtp_weights_are_skipped_and_the_vision_tower_never_loads(hybrid_reference, tmp_path):
    """A published Qwen3.5 checkpoint carries a multi-token-prediction head (mtp.*): left in the checkpoint
    for speculative decoding, not an error; the vision tower is skipped by the weights mapper."""
    from safetensors.torch import save_file
    path, prompts, expected = hybrid_reference("qwen3_5-vl")
    copy = tmp_path / "with-mtp"
    shutil.copytree(path, copy)
    save_file({"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.input_layernorm.weight": torch.zeros(64)},
              str(copy / "mtp.safetensors"))
    llm = LLM(str(copy), device="cpu")
    model = llm.engine.runner.model
    assert sorted(model.skipped_mtp_tensors) == ["mtp.fc.weight", "mtp.layers.0.input_layernorm.weight"]
    assert not any("visual" in name for name, _ in model.named_parameters())
    assert [outs[0] for outs in greedy(llm, prompts[:2])] == expected[:2]


def test_planner_counts_the_state_pool_and_the_weights(hybrid_reference):
    """What the engine holds is what the torch-free arithmetic says: parameters, KV blocks plus one state
    slot per seat (max_num_seqs), conv state in the model dtype and the recurrent state in float32."""
    from engine.kv.kv_cache_interface import model_kv_layout
    from engine.config.model import ModelConfig
    path, _, _ = hybrid_reference("qwen3_5_moe")
    cfg = ModelConfig.from_folder(path)
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2 and cfg.attention_layer_ids == [1, 3]
    llm = LLM(str(path), device="cpu", max_num_seqs=5)
    runner = llm.engine.runner
    assert sum(p.numel() for p in runner.model.parameters()) == cfg.num_params
    layout = model_kv_layout(cfg, 16, 4, act_dtype_bytes=4)
    assert [g.layer_ids for g in layout.groups] == [(0, 1)] and layout.state.layer_ids == (0, 2)
    # per layer: conv [2*32 + 64, 3] + state [4, 16, 16] floats
    assert layout.state.spec.slot_bytes == (128 * 3 + 4 * 16 * 16) * 4
    kv = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert runner.kv_cache_bytes() - kv == layout.state_pool_bytes(5, enable_prefix_caching=True)
    assert layout.state_pool_bytes(5, True) == (5 + 4) * 2 * layout.state.spec.slot_bytes  # 4 snapshots
    assert all(ssm.dtype == torch.float32 for _, ssm in runner.state_cache)
    # speculating, the verify scratch (rollback of rejected drafts) is planned as the engine reserves it
    from engine.planning.kv import verify_scratch_tokens
    from engine.planning.planner import plan_cpu
    plain = plan_cpu(cfg, 0.01, max_num_seqs=5)
    spec = plan_cpu(cfg, 0.01, max_num_seqs=5, num_speculative_tokens=3)
    assert verify_scratch_tokens(5, 3, 8192) == 20 and verify_scratch_tokens(5, 0, 8192) == 0
    assert spec.weights_bytes - plain.weights_bytes == layout.verify_scratch_bytes(20) > 0


def test_planner_verdicts_from_the_published_configs():
    """Qwen3.6-27B (AWQ, FP8 KV): only its 16 full-attention layers take KV per token (a quarter of a dense
    64-layer model's), and each seat costs one state slot of its 48 DeltaNet layers, so more seats leave
    less context."""
    from engine.bench.hybrid import QWEN3_32B, QWEN3_6_27B, plan
    cfg, four = plan(QWEN3_6_27B, 1, 4)
    assert round(cfg.num_params / 1e9) == 27 and len(cfg.linear_attention.layers) == 48
    assert four.kv_bytes_per_token == 16 * 2 * 4 * 256  # 16 layers, K and V, 4 KV heads of 256, one byte each
    slot = 48 * ((2 * 16 * 128 + 48 * 128) * 3 * 2 + 48 * 128 * 128 * 4)  # conv in bf16, state in float32
    assert four.state_bytes == (4 + 4) * slot  # a slot per seat and 4 prefix-cache snapshots
    _, sixteen = plan(QWEN3_6_27B, 1, 16)
    assert sixteen.state_bytes == (16 + 4) * slot and sixteen.num_tokens < four.num_tokens
    _, two_cards = plan(QWEN3_6_27B, 2, 4)
    assert two_cards.state_bytes == 4 * slot and two_cards.fits  # heads and their states split across ranks
    _, dense = plan(QWEN3_32B, 1, 4)
    assert dense.kv_bytes_per_token == 4 * four.kv_bytes_per_token and dense.num_tokens < four.num_tokens
    _, crowded = plan(QWEN3_6_27B, 1, 256)
    assert not crowded.fits and "--max-num-seqs" in crowded.explain_misfit()


def test_tensor_parallel_2_splits_deltanet_heads_and_states(hybrid_reference):
    """Each rank keeps half of the DeltaNet key heads with their value heads, conv channels and state slots
    (Qwen3.5's fused in_proj_qkv split into its q, k and v parts); chunks of 8 cut the prompts."""
    import torch.distributed as dist
    path, prompts, expected = hybrid_reference("qwen3_5")
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=8, max_num_seqs=4)
    try:
        assert [outs[0] for outs in greedy(llm, prompts[:3])] == expected[:3]
        layer = llm.engine.runner.runner.model.state_layers()[0]  # rank 0's own ModelRunner
        assert layer.num_v_heads == 2 and layer.ssm_state.shape[1:] == (2, 16, 16)
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()


def test_prefix_cache_hit_restores_the_state_snapshot(hybrid_reference):
    """A shared 40-token system prompt: the first request's prompt chunk stops at token 32 (a block boundary)
    and leaves its state there as a snapshot; later requests hit those 32 tokens (KV blocks and state) and
    compute only the rest, with HF's output."""
    import random
    path, _, _ = hybrid_reference("qwen3_5")
    rng = random.Random(3)
    system = [rng.randrange(5, 400) for _ in range(40)]
    prompts = [system + [rng.randrange(5, 400) for _ in range(n)] for n in (3, 17, 30, 1)]
    expected = hf_greedy(path, prompts, [8] * len(prompts))
    llm = LLM(str(path), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate([prompts[0]], [params], use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected[0] and first.num_cached_tokens == 0
    later = llm.generate(prompts[1:], [params] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in later] == expected[1:]
    assert all(o.num_cached_tokens == 32 for o in later)
    assert_no_state_held(llm)
    engine = llm.engine  # the engine-state picture of the state pool: a running request's slot, the snapshots
    engine.add_request("live", prompts[1], params)
    engine.step()
    snap = engine.block_pool_snapshot()
    slots = snap.state_slots
    held = engine.scheduler.running[0].state_slot
    assert slots["num_slots"] == engine.kv.state.pool.num_slots and slots["max_snapshots"] == 4
    assert slots["kind"][held] == 1 and snap.owner_ids[slots["owner"][held] - 1] == "live"
    assert sorted(i for i, k in enumerate(slots["kind"]) if k == 2) == sorted(engine.kv.snapshots.values())
    assert slots["slot_bytes"] == engine.kv_layout.state_bytes_per_seq > 0
    engine.abort_request("live")
    off = LLM(str(path), device="cpu", enable_prefix_caching=False)
    assert not off.engine.kv.num_snapshot_slots and off.engine.runner.state_cache[0][0].shape[0] == 256
