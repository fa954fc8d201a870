"""The prefix cache's CPU-RAM tier (--kv-offloading-size): bookkeeping states after each operation, then end to end on
CPU, where the device pool and the host tier are both CPU memory through the same code path.

A session re-sends a shared context after other prompts have pushed it out of a device pool too small for both: with
the tier its blocks come back by copy instead of recomputation, and greedy ids are identical with the tier on and off
(dense, sliding-window and hybrid models, and tensor parallel on two ranks). A restored block's bytes equal what was
stored, and a sequence whose copies are held back (the copy queue waits on an event) is never scheduled meanwhile.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config.flags import EngineConfig
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.offload.connector import HostBlock, OffloadConnector
from engine.kv.offload.host_pool import HostPool
from engine.kv.offload.reuse_gate import ReuseGate
from engine.kv.kv_cache_interface import model_kv_layout
from engine.config.model import ModelConfig
from engine.planning.offload import check_host_tier, plan_host_tier
from test_block_pool import fake_seq

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
_rng = random.Random(0)
CONTEXT = [_rng.randrange(5, 400) for _ in range(100)]  # the shared context: 6 full blocks of 16
OTHERS = [[_rng.randrange(5, 400) for _ in range(100)] for _ in range(2)]


# ---- bookkeeping ---------------------------------------------------------------------------------------------------

def test_host_pool_evicts_least_recently_used_but_never_a_pinned_slot():
    pool = HostPool(2)
    assert pool.allocate(b"a") == 0 and pool.allocate(b"b") == 1
    pool.touch(b"a")  # b is now the least recently used
    pool.pin(1)
    assert pool.allocate(b"c") == 0 and b"a" not in pool and b"b" in pool  # b is pinned: a goes
    pool.pin(0)
    assert pool.allocate(b"d") is None  # every slot pinned: no room, nothing evicted
    pool.unpin(1)
    assert pool.allocate(b"d") == 1 and list(pool.slots) == [b"c", b"d"]


def test_reuse_gate_admits_on_the_second_use_and_forgets_the_oldest():
    assert all(ReuseGate().admit(k) for k in (b"a", b"a", b"b"))  # the default stores everything
    gate = ReuseGate(min_uses=2, capacity=2)
    assert not gate.admit(b"a") and gate.admit(b"a")
    assert not gate.admit(b"b") and not gate.admit(b"c")  # b and c push a out
    assert not gate.admit(b"a")


def computed(kv: KVCacheManager, seq) -> None:
    """Allocate a fresh sequence's prompt and mark it computed (the forward wrote it)."""
    assert kv.allocate_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens


def test_freed_blocks_are_stored_evicted_then_loaded_back_and_findable_only_after_the_copy():
    tier = OffloadConnector(num_blocks=8, bytes_per_block=100)
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True, offload=tier)
    first = fake_seq(list(range(10)))
    computed(kv, first)
    ids = [b.block_id for b in first.block_table[:2]]
    kv.free(first)  # two full blocks: both stored (the partial third is not cached)
    transfers = tier.take()
    assert transfers.batch == 1 and transfers.stores == [(ids[1], 0), (ids[0], 1)] and not transfers.fence
    other = fake_seq([99] * 16)
    computed(kv, other)  # takes every block: the two cached ones are overwritten, so the forward waits for the store
    assert tier.take().fence == 1
    kv.free(other)
    tier.complete(1)
    again = fake_seq(list(range(10)) + [5])
    hit = kv.get_computed_blocks(again)
    assert len(hit) == 2 and hit.num_loads == 2 and all(isinstance(b, HostBlock) for b in hit.blocks[0])
    assert kv.allocate_slots(again, 0, hit) and again.kv_load_batch == 2 and again.num_computed_tokens == 8
    loads = tier.take(forward=False)
    assert [slot for slot, _ in loads.loads] == [1, 0] and tier.blocks.pins == {0: 1, 1: 1}
    twin = fake_seq(list(range(10)))
    assert kv.get_computed_blocks(twin, use_tier=False) == []  # the loading blocks are not in the device cache yet
    tier.complete(2)
    kv.finish_load(again)
    assert not tier.blocks.pins
    assert [b.block_id for b in kv.get_computed_blocks(twin).blocks[0]] == [b.block_id for b in again.block_table[:2]]
    assert tier.stats.hit_tokens == 8 and tier.stats.blocks_loaded == 2


def test_host_tier_plan_and_a_tier_too_small_for_one_block():
    cfg = ModelConfig(architecture="LlamaForCausalLM", hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                      max_model_len=8192)
    layout = model_kv_layout(cfg, 16, 2, 2)  # per rank of two: 4 KV heads
    plan = plan_host_tier(layout, 64.0, 2)
    assert plan.bytes_per_block == 32 * 2 * 16 * 4 * 128 * 2 == 1 << 20
    assert plan.num_blocks == 32 * 1024 and plan.total_bytes == 64 << 30 and not plan.num_state_slots
    with pytest.raises(ValueError, match="holds no KV block: one block id takes 1.0 MiB on each of 2 rank"):
        check_host_tier(plan_host_tier(layout, 0.001, 2), 0.001)


def test_the_tier_needs_the_prefix_cache():
    with pytest.raises(ValueError, match="prefix caching is off"):
        EngineConfig(model="m", kv_offloading_size=1.0, enable_prefix_caching=False).validate()


# ---- end to end ----------------------------------------------------------------------------------------------------

def session(llm: LLM, others: list[list[int]]) -> tuple[list[list[int]], int]:
    """Turn one on the context, other prompts that push it out of the device pool, turn two re-sending it all:
    every output's ids and turn two's cached tokens."""
    def greedy(prompt):
        return llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    first = greedy(CONTEXT + [7, 8, 9])
    outs = [first.outputs[0].token_ids] + [greedy(p).outputs[0].token_ids for p in others]
    second = greedy(CONTEXT + [7, 8, 9] + first.outputs[0].token_ids + [11, 12])
    return outs + [second.outputs[0].token_ids], second.num_cached_tokens


CASES = {  # case: (arch, device blocks, the other prompts, engine flags): a pool too small for context and other
    "llama": ("llama", 10, OTHERS[:1], {}),
    "gemma3": ("gemma3", 16, OTHERS[:1], {}),  # a full group and two 8-token window groups share the pool
    "qwen3_5": ("qwen3_5", 10, OTHERS, {}),  # two others push the context's state snapshots out to the tier too
    "llama-int4": ("llama", 10, OTHERS[:1], {"kv_cache_dtype": "int4"}),  # the scales travel with the values
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_ids_identical_with_the_tier_on_and_off(tiny_model_dir, case):
    arch, blocks, others, flags = CASES[case]
    engine = dict(device="cpu", num_gpu_blocks_override=blocks, max_num_seqs=2, max_num_batched_tokens=32, **flags)
    path = tiny_model_dir(arch)
    off, cached_off = session(LLM(str(path), **engine), others)
    llm = LLM(str(path), kv_offloading_size=0.01, **engine)
    on, cached_on = session(llm, others)
    stats = llm.engine.kv.offload.snapshot_stats()
    print(f"{arch}: cached tokens off {cached_off}, on {cached_on}; {stats}")
    assert all(off) and on == off
    assert cached_on > cached_off and stats.blocks_loaded > 0 and stats.hit_tokens > 0
    if arch == "qwen3_5":  # the hit ended at a state snapshot the tier held
        assert stats.states_stored > 0 and stats.states_loaded > 0
    assert llm.engine.kv.pool.num_free_blocks == blocks and not llm.engine.scheduler.loading


def test_restored_blocks_hold_the_bytes_that_were_stored(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", num_gpu_blocks_override=10, max_num_seqs=2,
              max_num_batched_tokens=32, kv_offloading_size=0.01)
    engine, runner = llm.engine, llm.engine.runner
    llm.generate([CONTEXT + [7, 8, 9]], GREEDY, use_tqdm=False)
    keys = []
    for block_hash in engine.kv.pool.cached:  # the context's blocks, cached and free: their pages as computed
        keys.append(block_hash)
    pages = {k: runner.kv_cache[:, :, engine.kv.pool.cached[k].block_id].clone() for k in keys}
    llm.generate(OTHERS[:1], GREEDY, use_tqdm=False)
    tier = engine.kv.offload
    assert set(keys) <= set(tier.blocks.slots)
    for k in keys:  # the host copy
        assert torch.equal(runner.offload.pages[0][1][tier.blocks.slots[k]], pages[k])
    restored = [k for k in keys if k not in engine.kv.pool.cached]
    assert restored, "the other prompt evicted none of the context's blocks"
    llm.generate([CONTEXT + [1, 2, 3]], GREEDY, use_tqdm=False)
    for k in restored:  # back in the device pool, under their key, byte for byte
        assert torch.equal(runner.kv_cache[:, :, engine.kv.pool.cached[k].block_id], pages[k])


def test_no_sequence_runs_while_its_copies_are_held(tiny_model_dir):
    """The copy queue holds every batch with loads until an event is set: the sequence waiting for them stays in
    `loading` (never scheduled) while another request keeps stepping; released, it gives the tier-off output."""
    path = str(tiny_model_dir("llama"))
    engine_args = dict(device="cpu", num_gpu_blocks_override=12, max_num_seqs=2, max_num_batched_tokens=32)
    turn2 = CONTEXT + [1, 2, 3]
    expected = LLM(path, **engine_args).generate([turn2], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(path, kv_offloading_size=0.01, **engine_args)
    llm.generate([CONTEXT + [7, 8, 9]], GREEDY, use_tqdm=False)
    llm.generate(OTHERS[:1], GREEDY, use_tqdm=False)
    engine, tier = llm.engine, llm.engine.runner.offload
    release, copy = threading.Event(), tier.copy

    def held_copy(transfers):
        if transfers.loads:
            assert release.wait(60), "never released"
        copy(transfers)

    tier.copy = held_copy
    engine.add_request("turn2", turn2, GREEDY)
    engine.add_request("bystander", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    (seq,) = engine.requests["turn2"].seqs
    (bystander,) = engine.requests["bystander"].seqs
    for _ in range(6):
        engine.step()
        assert seq in engine.scheduler.loading and seq not in engine.scheduler.running
        assert seq.kv_load_batch > engine.kv.offload.completed
    assert bystander.num_output_tokens >= 5  # the rest of the engine went on
    release.set()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["turn2"].outputs[0].token_ids == expected and done["turn2"].num_cached_tokens == 96


def test_an_aborted_loading_request_keeps_its_blocks_until_its_copies_ran(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", num_gpu_blocks_override=10, max_num_seqs=2,
              max_num_batched_tokens=32, kv_offloading_size=0.01)
    llm.generate([CONTEXT + [7, 8, 9]], GREEDY, use_tqdm=False)
    llm.generate(OTHERS[:1], GREEDY, use_tqdm=False)
    engine, tier = llm.engine, llm.engine.runner.offload
    release, copy = threading.Event(), tier.copy
    tier.copy = lambda t: (release.wait(60), copy(t))
    engine.add_request("turn2", CONTEXT + [1, 2, 3], GREEDY)
    engine.step()
    (seq,) = engine.requests["turn2"].seqs
    assert seq in engine.scheduler.loading
    held = engine.kv.num_held_blocks(seq)
    engine.abort_request("turn2")
    assert engine.kv.pool.num_free_blocks == 10 - held  # its copies still write into its blocks
    release.set()
    assert engine.runner.wait_kv_transfers(seq.kv_load_batch, 10)
    engine.step()
    assert engine.kv.pool.num_free_blocks == 10 and not engine.scheduler.loading


def test_tensor_parallel_ranks_each_restore_their_shard(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    engine = dict(device="cpu", num_gpu_blocks_override=10, max_num_seqs=2, max_num_batched_tokens=32)
    off, _ = session(LLM(path, **engine), OTHERS[:1])
    llm = LLM(path, tensor_parallel_size=2, kv_offloading_size=0.02, **engine)
    try:
        on, cached = session(llm, OTHERS[:1])
        assert llm.engine.kv.offload.stats.blocks_loaded > 0
    finally:
        llm.engine.shutdown()
    assert on == off and cached == 96


def test_stats_reach_the_engine_stats(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", num_gpu_blocks_override=10, max_num_seqs=2,
              max_num_batched_tokens=32, kv_offloading_size=0.01)
    session(llm, OTHERS[:1])
    tier = llm.engine.get_stats().kv_offload
    assert tier["hit_tokens"] == 48 and tier["blocks_held"] > 0 and tier["bytes_loaded"] == 3 * 8192
    assert tier["capacity_bytes"] == tier["num_blocks"] * 8192



def test_the_server_reports_the_tier_in_metrics_and_engine_state(tiny_model_dir):
    import httpx

    from server_harness import MODEL_NAME, start_server
    srv = start_server(tiny_model_dir("llama"), num_gpu_blocks_override=10, max_num_seqs=2, max_num_batched_tokens=32,
                       kv_offloading_size=0.01)
    try:
        body = dict(model=MODEL_NAME, max_tokens=8, temperature=0, ignore_eos=True)
        first = httpx.post(srv.base_url + "/completions", json=dict(body, prompt=CONTEXT + [7, 8, 9])).json()
        httpx.post(srv.base_url + "/completions", json=dict(body, prompt=OTHERS[0])).raise_for_status()
        again = httpx.post(srv.base_url + "/completions", json=dict(body, prompt=CONTEXT + [1, 2, 3])).json()
        assert first["choices"][0]["text"] is not None and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        tier = httpx.get(srv.base_url + "/engine/state").json()["kv_offload"]
        assert tier["hit_tokens"] == 48 and tier["blocks_held"] > 0 and tier["bytes_loaded"] > 0
        metrics = httpx.get(srv.url + "/metrics").text
        assert f'pagedesk:kv_offload_hit_tokens_total{{model_name="{MODEL_NAME}"}} 48.0' in metrics
        assert "pagedesk:kv_offload_usage_perc" in metrics and "pagedesk:kv_offload_loaded_bytes_total" in metrics
    finally:
        srv.stop()
