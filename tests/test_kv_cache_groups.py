"""KV cache groups: the layout, exact block counts as a sliding-window group frees blocks, the window prefix-hit
rule, forks, and greedy parity with HF for a model mixing window and full layers (chunked prefill with chunk
boundaries inside the window, prefix caching, forced preemption, n>1, and a sequence that fits only because
window blocks are freed)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from engine.kv.block_pool import NULL_BLOCK
from engine.kv.kv_cache_interface import (FullAttentionSpec, SlidingWindowSpec, build_layout, group_size, layer_specs,
                                       model_kv_layout)
from engine.kv.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence
from engine.config.model import ModelConfig
from hf_reference import hf_greedy
from tiny_models import make_tiny_model

BS = 4
FULL, WINDOW6 = FullAttentionSpec(BS, 1, 1, 1), SlidingWindowSpec(BS, 1, 1, 1, 6)
# Gemma-3-shaped: five window layers to one full layer, as HF applies them through Qwen2's layer_types.
LAYER_TYPES = ("sliding_attention",) * 5 + ("full_attention",)
WINDOW = 24


class FakeSeq(SimpleNamespace):
    table_edits: dict
    mark_table_edit = Sequence.mark_table_edit  # the managers mark in-place table edits for the input batch

    @property
    def block_table(self):
        return self.block_tables[0]


def fake_seq(tokens: list[int]) -> FakeSeq:
    return FakeSeq(token_ids=list(tokens), num_computed_tokens=0, block_tables=[[]], block_hashes=[], table_edits={},
                   request=SimpleNamespace(cache_salt=None, pooling=None), num_cached_blocks=0, num_tokens=len(tokens),
                   params=SamplingParams())


def grow(kv: KVCacheManager, seq: FakeSeq, n: int = 1) -> bool:
    """Schedule `n` more tokens (a decode when n == 1) and mark them computed, as a step would."""
    seq.token_ids += [7] * max(0, seq.num_computed_tokens + n - len(seq.token_ids))
    seq.num_tokens = len(seq.token_ids)
    if not kv.allocate_slots(seq, n):
        return False
    seq.num_computed_tokens += n
    return True


# ---- layout -------------------------------------------------------------------------------------------------

def test_one_spec_is_one_group_of_every_layer():
    layout = build_layout([FULL] * 5)
    assert len(layout.groups) == 1 and layout.num_slots == 5 and layout.layer_slots == [0, 1, 2, 3, 4]
    assert layout.bytes_per_block == 5 * FULL.page_size_bytes and not layout.has_sliding_window


def test_gemma3_27b_groups_waste_the_fewest_slots():
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]  # 52 window layers, 10 full
    assert group_size([52, 10]) == 13  # 13 × (4 + 1) = 65 slots; 10 slots would be 70, 12 would be 72
    layout = build_layout(layer_specs(windows, 16, 16, 128, 2))
    assert layout.num_slots == 13 and [len(g.layer_ids) for g in layout.groups] == [10, 13, 13, 13, 13]
    assert layout.groups[0].spec.kind == "full_attention"
    assert layout.layer_groups[5] == 0 and layout.layer_slots[11] == 1 and layout.layer_groups[0] == 1
    # Each block id costs 13 layer pages instead of 62; each group's table has its own ids.
    assert layout.bytes_per_block == 13 * 2 * 16 * 16 * 128 * 2


def test_layout_refuses_unequal_page_sizes():
    with pytest.raises(ValueError, match="different KV page sizes"):
        build_layout([FULL, SlidingWindowSpec(BS, 2, 1, 1, 6)])


def test_window_bound_is_window_plus_chunk():
    spec = SlidingWindowSpec(16, 1, 1, 1, 1024)
    assert spec.window_blocks == 64  # 1023 earlier keys
    assert spec.max_blocks_per_seq(131072, 512) == -(-(1023 + 512) // 16) + 1 == 97
    assert spec.max_blocks_per_seq(100, 512) == 7  # never more than max_model_len needs


def test_planner_arithmetic_for_gemma3_27b_by_hand():
    from engine.bench.kv_groups import gemma3_27b
    from engine.planning.planner import plan_capacity
    from engine.planning.units import GIB
    cfg = gemma3_27b()
    kwargs = dict(dtype="bfloat16", quantization="awq", max_num_batched_tokens=2048)
    on = plan_capacity(cfg, [24 * GIB], 0.9, **kwargs)
    off = plan_capacity(cfg, [24 * GIB], 0.9, window_freeing=False, **kwargs)
    assert on.kv_budget_bytes == off.kv_budget_bytes > 0
    page = 2 * 16 * 16 * 128 * 2  # K and V of 16 tokens, 16 KV heads of 128, bf16: one layer
    assert off.kv_bytes_per_token * 16 == 62 * page and on.kv_bytes_per_token * 16 == 13 * page
    assert off.num_blocks == off.kv_budget_bytes // (62 * page) and off.num_tokens == 16 * off.num_blocks
    blocks = on.kv_budget_bytes // (13 * page)
    window = -(-(1023 + 2048) // 16) + 1  # 193 blocks per window group at its peak
    assert on.num_blocks == blocks and on.num_tokens == 16 * (blocks - 4 * window)  # 4 window groups
    assert on.num_full_seqs == blocks // (131072 // 16 + 4 * window)
    assert on.num_tokens > 3 * off.num_tokens


def test_cpu_plan_caps_the_pool_at_max_num_seqs_peaks():
    from engine.planning.planner import plan_cpu
    cfg = ModelConfig(architecture="MistralForCausalLM", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=128, vocab_size=100, max_position_embeddings=512,
                      sliding_windows=[48, 48], max_model_len=512)
    plan = plan_cpu(cfg, 1.0, max_num_seqs=4, max_num_batched_tokens=32)
    per_seq = -(-(47 + 32) // 16) + 1  # 6 blocks: an all-window model never needs more per sequence
    assert plan.num_blocks == plan.max_blocks == 4 * per_seq and plan.num_full_seqs == 4
    assert plan.num_tokens == 512  # the pool never limits the length: max_model_len


# ---- exact block counts ---------------------------------------------------------------------------------------

def test_window_group_frees_blocks_behind_the_window_step_by_step():
    kv = KVCacheManager(16, BS, enable_caching=False, group_specs=[FULL, WINDOW6])
    seq = fake_seq(list(range(7)))
    assert kv.allocate_slots(seq, 7)
    seq.num_computed_tokens = 7
    free = [kv.pool.num_free_blocks]  # 2 blocks in each group
    for _ in range(7):
        assert grow(kv, seq)
        free.append(kv.pool.num_free_blocks)
    # Next token at 8: a new block per group. At 9 its window starts at 4: block 0 is behind it and freed.
    # At 12 another block per group; at 13 block 1 falls behind.
    assert free == [12, 12, 10, 11, 11, 11, 9, 10]
    assert seq.block_tables[1][:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in seq.block_tables[0]
    for _ in range(200):  # from then on: the window group holds at most 3 blocks, the full group all
        assert grow(kv, seq)
        held = [sum(b is not NULL_BLOCK for b in t) for t in seq.block_tables]
        assert held[0] == -(-seq.num_computed_tokens // BS) and held[1] <= 3
        if held[0] == 12:  # 12 + 3 of 16: the next block would not fit
            break
    kv.free(seq)
    assert kv.pool.num_free_blocks == 16 and all(b.ref_count == 0 for b in kv.pool.blocks)


def test_every_group_draws_on_the_one_pool_so_a_long_sequence_can_outgrow_it():
    # The Gemma 2 preemption test's longest sequence (68 prompt tokens + 30, block size 8, window 20): at its
    # last step (96 computed, 1 new) the full group holds 13 blocks and the window group 4 (keys 77..96 lie in
    # blocks 9..12): 17 block ids. A pool of 16 ids holds 16 one-layer pages, half of what 16 all-layer blocks
    # held before groups, so the sequence stops one token short of max_tokens; 17 ids hold it.
    full, window = FullAttentionSpec(8, 1, 1, 1), SlidingWindowSpec(8, 1, 1, 1, 20)
    for num_blocks, fits in [(16, False), (17, True)]:
        kv = KVCacheManager(num_blocks, 8, enable_caching=True, group_specs=[full, window])
        seq = fake_seq(list(range(68)))
        for chunk in (24, 24, 20):  # the prompt in chunks of max_num_batched_tokens=24
            assert grow(kv, seq, chunk)
        while seq.num_computed_tokens < 96:
            assert grow(kv, seq)
        assert [kv.managers[g].num_held_blocks_after(96, 97) for g in (0, 1)] == [13, 4]
        assert kv.explain_misfit(96, 1) == ("97 tokens need 17 KV blocks of 8 tokens (13 full + 4 window-20), "
                                            f"more than the pool's {num_blocks}")
        assert grow(kv, seq) is fits
        held = [sum(b is not NULL_BLOCK for b in t) for t in seq.block_tables]
        assert held == ([13, 4] if fits else [12, 3])  # a step that does not fit leaves the tables as they were
        kv.free(seq)
        assert kv.pool.num_free_blocks == num_blocks


def test_a_chunk_frees_what_lies_behind_its_first_token():
    kv = KVCacheManager(40, BS, enable_caching=False, group_specs=[WINDOW6])
    seq = fake_seq(list(range(40)))
    assert kv.allocate_slots(seq, 16) and kv.pool.num_free_blocks == 36
    seq.num_computed_tokens = 16
    assert kv.allocate_slots(seq, 16)  # the chunk [16, 32) sees keys from 11: blocks 0 and 1 go, 4 come
    assert kv.pool.num_free_blocks == 34 and seq.block_table[:2] == [NULL_BLOCK, NULL_BLOCK]


def test_window_prefix_hit_needs_the_blocks_inside_the_window():
    kv = KVCacheManager(40, BS, enable_caching=True, group_specs=[FULL, WINDOW6])
    first = fake_seq(list(range(22)))
    assert kv.allocate_slots(first, 22)
    first.num_computed_tokens = 22
    kv.free(first)  # every full block stays cached in both groups
    twin = fake_seq(list(range(22)) + [99])
    hit = kv.get_computed_blocks(twin)
    assert len(hit) == 5  # 5 full blocks; the full group's run is all of them
    assert hit.blocks[1][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in hit.blocks[1][3:]  # the window: 2 blocks
    assert kv.allocate_slots(twin, 3, hit) and twin.num_computed_tokens == 20
    assert kv.pool.num_free_blocks == 40 - 6 - 3  # full: 5 hits + 1 new; window: 2 hits + 1 new
    kv.free(twin)
    # Evict the window group's block 4 (the hit's last): the hit drops to the latest point that still has a
    # whole window cached, and the full group is cut to the same length.
    victim = kv.pool.lookup(first.block_hashes[4] + (1).to_bytes(2, "little"))
    kv.pool.touch([victim])
    kv.pool.uncache_block(victim)
    hit = kv.get_computed_blocks(fake_seq(list(range(22)) + [99]))
    assert len(hit) == 4 and hit.blocks[1][:2] == [NULL_BLOCK] * 2


def test_a_hit_is_taken_in_every_group_before_any_group_allocates():
    """The window group's hit blocks sit in the free queue ahead of what the full group allocates: they must
    leave it before the full group's new blocks are taken, or the full group would evict them."""
    kv = KVCacheManager(12, BS, enable_caching=True, group_specs=[FULL, WINDOW6])
    a, d = fake_seq(list(range(9))), fake_seq(list(range(50, 59)))
    for seq in (a, d):
        assert kv.allocate_slots(seq, 9)
        seq.num_computed_tokens = 9
    window_hit = [b.block_id for b in a.block_tables[1][:2]]
    kv.free(a)
    kv.free(d)  # queue: a's full blocks, a's window blocks, then d's
    b = fake_seq(list(range(9)) + [99] * 15)
    hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in hit.blocks[1]] == window_hit
    assert kv.allocate_slots(b, 16, hit)  # 4 new blocks per group + 4 hit blocks: the whole pool
    full_ids, window_ids = ({x.block_id for x in t} for t in b.block_tables)
    assert not full_ids & window_ids and [x.block_id for x in b.block_tables[1][:2]] == window_hit


def test_forks_share_every_group_and_copy_on_write():
    kv = KVCacheManager(24, BS, enable_caching=False, group_specs=[FULL, WINDOW6])
    parent = fake_seq(list(range(14)))
    assert kv.allocate_slots(parent, 14)
    parent.num_computed_tokens = 14
    assert grow(kv, parent)  # at 14 the window starts at 9: blocks 0 and 1 freed
    child = fake_seq(parent.token_ids)
    kv.fork(parent, child)
    assert child.block_tables[1][:2] == [NULL_BLOCK] * 2 and kv.pool.num_free_blocks == 24 - 4 - 2
    assert grow(kv, child)  # its last block is shared in both groups: one copy each
    assert len(kv.take_copies()) == 2 and kv.pool.num_free_blocks == 24 - 8
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free_blocks == 24


def test_models_without_windows_keep_one_group(tiny_model_dir):
    cfg = ModelConfig.from_folder(tiny_model_dir("llama"))
    layout = model_kv_layout(cfg, 16)
    assert len(layout.groups) == 1 and layout.num_slots == cfg.num_layers


# ---- against HF ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_like(tmp_path_factory):
    """Six Qwen2 layers, five with a 24-token window and one full, with prompts longer than the window (weights
    drawn wide enough that greedy output does not settle into one repeated token)."""
    path = make_tiny_model(tmp_path_factory.mktemp("gemma-like"), "qwen2", num_hidden_layers=6,
                           use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, initializer_range=0.2,
                           layer_types=list(LAYER_TYPES))
    cfg = ModelConfig.from_folder(path)
    assert cfg.sliding_windows == [WINDOW] * 5 + [None]
    rng = random.Random(3)
    shared = [rng.randrange(5, 400) for _ in range(40)]
    prompts = [shared + [rng.randrange(5, 400) for _ in range(n)] for n in (3, 50, 110)]
    max_tokens = [40, 30, 20]
    return path, prompts, max_tokens, hf_greedy(path, prompts, max_tokens)


def greedy(llm: LLM, prompts, max_tokens, n: int = 1):
    params = [SamplingParams(temperature=0, max_tokens=m, n=n) for m in max_tokens]
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_pool_empty(llm: LLM) -> None:
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)


def test_gemma_shaped_model_has_two_kinds_of_group(gemma_like):
    llm = LLM(str(gemma_like[0]), device="cpu", num_gpu_blocks_override=64)
    layout = llm.engine.kv_layout
    assert [g.spec.kind for g in layout.groups] == ["full_attention"] + ["sliding_window"] * 5
    assert llm.engine.runner.kv_cache.shape[0] == 1  # one cache slot: each group holds one layer


@pytest.mark.parametrize("budget", [8, 20])
def test_chunked_prefill_with_boundaries_inside_the_window_matches_hf(gemma_like, budget):
    path, prompts, max_tokens, expected = gemma_like
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert greedy(llm, prompts, max_tokens) == [[e] for e in expected]
    assert_pool_empty(llm)


def test_prefix_caching_preemption_and_n_match_hf(gemma_like):
    path, prompts, max_tokens, expected = gemma_like
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=32, num_gpu_blocks_override=44)
    assert greedy(llm, prompts[:1], max_tokens[:1]) == [[expected[0]]]
    out = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == expected
    assert sum(o.num_cached_tokens for o in out) > 0  # the shared 40-token prefix hit
    assert llm.engine.scheduler.num_preemptions > 0  # 44 blocks cannot hold all three at once
    assert greedy(llm, prompts[1:2], max_tokens[1:2], n=3) == [[expected[1]] * 3]
    assert_pool_empty(llm)


def test_long_sequence_fits_only_because_window_blocks_are_freed(gemma_like):
    path, _, _, _ = gemma_like
    rng = random.Random(5)
    prompt, max_tokens = [rng.randrange(5, 400) for _ in range(380)], 60
    expected = hf_greedy(path, [prompt], [max_tokens])
    num_blocks = 60
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=32, num_gpu_blocks_override=num_blocks,
              enable_prefix_caching=False)
    # Without freeing the same memory (60 one-layer pages) holds 10 blocks of all six layers: 160 tokens.
    layout = llm.engine.kv_layout
    no_freeing = num_blocks * layout.num_slots // layout.num_layers * 16
    assert no_freeing == 160 < len(prompt) + max_tokens
    engine, peak = llm.engine, 0
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    tokens = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens = o.outputs[0].token_ids
        peak = max(peak, engine.kv.pool.num_blocks - engine.kv.pool.num_free_blocks)
    assert tokens == expected[0] and engine.scheduler.num_preemptions == 0
    # 28 full-group blocks for 440 tokens, each window group ≤ cdiv(23 + 32, 16) + 1 = 5.
    assert peak <= 28 + 5 * 5
    assert_pool_empty(llm)


def test_snapshot_state_and_block_map_show_the_groups(gemma_like, qtbot):
    from app.engine_state import parse_state
    from engine.entrypoints.openai.engine_state import build_state, collect_raw
    from widgets.block_map import BlockMapWidget

    llm = LLM(str(gemma_like[0]), device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=64)
    engine = llm.engine
    engine.add_request("r", gemma_like[1][2], SamplingParams(temperature=0, max_tokens=4))
    for _ in range(3):  # 150 prompt tokens in chunks of 64: 10 full-group blocks, window groups only their window
        engine.step()
    snap = engine.block_pool_snapshot()
    assert snap.group_names[0] == "full attention · 1 layer" and snap.group_names[1] == "window 24 · 1 layer"
    held = [sum(b is not NULL_BLOCK for b in t) for t in engine.requests["r"].seqs[0].block_tables]
    assert [int((snap.group == g).sum()) for g in range(6)] == held and held[0] == 10 and max(held[1:]) <= 4
    assert snap.requests[0].num_blocks == sum(held)
    state = parse_state(build_state(collect_raw(engine), "m", (0.0, 0.0)))
    assert state.kv_groups == snap.group_names
    widget = BlockMapWidget()
    qtbot.addWidget(widget)
    widget.set_blocks(state.blocks)
    widget.redraw()
    assert f"full attention · 1 layer: {held[0]}" in widget.summary.text()
    used = int((snap.state == 1).nonzero()[0][0])  # a block in use: its group is named on hover
    assert "· group " in widget.block_info(used)


def test_tensor_parallel_workers_read_the_same_groups(gemma_like):
    path, prompts, max_tokens, expected = gemma_like
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=20)
    try:
        assert greedy(llm, prompts[1:], max_tokens[1:]) == [[e] for e in expected[1:]]
    finally:
        llm.engine.shutdown()
