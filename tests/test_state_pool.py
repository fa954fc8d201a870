"""The hybrid models' state pool (engine/kv/state_pool.py) behind KVCacheManager: exact behaviour of admission,
forks and frees, and under random operations no slot leaked and no slot shared without a copy.

The hypothesis test models what each slot holds as the tokens its state summarises: a forward checks that a
sequence continuing its state finds exactly its own history in its slot (forks get theirs through the pending
copies, applied all at once before the forward), then writes its new history there.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.state_pool import StatePool
from test_block_pool import fake_seq


def hybrid_seq(tokens):
    seq = fake_seq(tokens)
    seq.state_slot, seq.num_prompt_tokens = None, len(tokens)
    return seq


def test_slots_come_lowest_first_and_go_back():
    pool = StatePool(3)
    assert [pool.allocate(), pool.allocate()] == [0, 1]
    pool.free(0)
    assert pool.allocate() == 0 and pool.num_free == 1
    with pytest.raises(RuntimeError, match="freed but not held"):
        pool.free(2)
    pool.allocate()
    with pytest.raises(RuntimeError, match="all held"):
        pool.allocate()
    with pytest.raises(ValueError, match="at least one slot"):
        StatePool(0)


def test_admission_takes_a_slot_and_a_full_pool_refuses():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True, num_state_slots=2)
    assert not kv.enable_caching  # a prefix hit could not restore the recurrent state
    a, b, c = hybrid_seq([1] * 5), hybrid_seq([2] * 5), hybrid_seq([3] * 5)
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 5)
    assert (a.state_slot, b.state_slot) == (0, 1)
    blocks_free = kv.pool.num_free_blocks
    assert not kv.allocate_slots(c, 5) and c.state_slot is None and kv.pool.num_free_blocks == blocks_free
    kv.free(a)
    assert a.state_slot is None and kv.allocate_slots(c, 5) and c.state_slot == 0


def test_fork_copies_the_slot_or_takes_it_over():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False, num_state_slots=3)
    parent = hybrid_seq([1] * 6)
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = hybrid_seq(parent.token_ids)
    kv.fork(parent, child)
    assert kv.take_state_copies() == [(parent.state_slot, child.state_slot)] and child.state_slot != parent.state_slot
    heir = hybrid_seq(parent.token_ids)
    slot = parent.state_slot
    kv.fork(parent, heir, take_state=True)  # the parent ends this step: its last child keeps its slot
    assert heir.state_slot == slot and parent.state_slot is None and not kv.take_state_copies()
    kv.free(parent)  # its blocks go; the slot it handed over stays with the heir
    assert kv.state.pool.held() == {child.state_slot, heir.state_slot}


operations = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "fork", "fork_end", "preempt"]),
                                st.integers(0, 40)), max_size=50)


@settings(max_examples=150, deadline=None)
@given(ops=operations, snapshots=st.sampled_from([0, 2]))
def test_no_slot_leaked_and_none_shared_without_a_copy(ops, snapshots):
    """With snapshots, prefix hits restore them: the restored state must be the hit's own history too."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=bool(snapshots), num_state_slots=5,
                        num_snapshot_slots=snapshots)
    held: dict[int, tuple] = {}  # slot -> the tokens its state summarises
    live = []

    def forward(steps):
        """One step: pending copies first (forks, snapshots taken and restored, in the order they were made, as
        the model runner applies them), then each scheduled sequence's layer reads its slot (when it
        continues a state) and writes its new history."""
        for src, dst in kv.take_state_copies():
            held[dst] = held.get(src)
        for seq, computed in steps:
            if computed:
                assert held.get(seq.state_slot) == tuple(seq.token_ids[:computed]), "a slot another sequence wrote"
            seq.num_computed_tokens = seq.num_tokens
            held[seq.state_slot] = tuple(seq.token_ids)
            kv.snapshot_state(seq)

    for op, arg in ops:
        if op == "add":
            seq = hybrid_seq([arg % 7] * (arg % 9 + 1))
            hits = kv.get_computed_blocks(seq)
            if kv.allocate_slots(seq, seq.num_tokens - len(hits) * 4, hits):
                live.append(seq)
                forward([(seq, seq.num_computed_tokens)])
        elif op == "grow" and live:
            seq = live[arg % len(live)]
            seq.token_ids.append(arg)
            seq.num_tokens += 1
            if kv.allocate_slots(seq, 1):
                forward([(seq, seq.num_tokens - 1)])
            else:
                seq.token_ids.pop()
                seq.num_tokens -= 1
        elif op == "free" and live:
            kv.free(live.pop(arg % len(live)))
        elif op == "preempt" and live:  # dropped, then recomputed from its tokens with a fresh state
            seq = live[arg % len(live)]
            kv.free(seq)
            if kv.allocate_slots(seq, seq.num_tokens):
                forward([(seq, 0)])
            else:
                live.remove(seq)
        elif op in ("fork", "fork_end") and live:
            parent = live[arg % len(live)]
            ends = op == "fork_end"
            if not ends and not kv.state.pool.num_free:
                continue  # the scheduler's seats never let a fork find the pool empty
            child = hybrid_seq(parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            kv.fork(parent, child, take_state=ends)
            if ends:
                live.remove(parent)
                kv.free(parent)
            child.token_ids.append(arg)  # its own sampled token, computed in the next step
            child.num_tokens += 1
            if kv.allocate_slots(child, 1):  # forks step right after they are made (they sample then)
                live.append(child)
                forward([(child, child.num_tokens - 1)])
            else:  # no room: it ends (the scheduler would preempt or stop it), its slot goes back
                kv.free(child)
        slots = [s.state_slot for s in live] + list(kv.snapshots.values())
        assert None not in slots and len(set(slots)) == len(slots)  # one holder each, never two
        assert kv.state.pool.held() == set(slots)  # nothing leaked
        assert len(kv.snapshots) <= snapshots
    for seq in live:
        kv.free(seq)
    assert kv.state.pool.num_used == len(kv.snapshots) and kv.pool.num_free_blocks == kv.pool.num_blocks


def test_snapshots_at_block_boundaries_restore_on_a_hit_and_keep_their_share():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True, num_state_slots=2, num_snapshot_slots=1)
    assert kv.enable_caching and kv.state.pool.num_slots == 3
    a = hybrid_seq(list(range(10)))
    a.num_prompt_tokens = 10
    assert kv.allocate_slots(a, 8)  # a chunk ending on the boundary at 8
    a.num_computed_tokens = 8
    kv.snapshot_state(a)
    (src, snap), = kv.take_state_copies()
    assert src == a.state_slot and kv.snapshots == {a.block_hashes[1]: snap}
    b = hybrid_seq(list(range(9)) + [99])
    b.num_prompt_tokens = 10
    hit = kv.get_computed_blocks(b)
    assert len(hit) == 2 and hit.state_snapshot == snap
    assert kv.allocate_slots(b, 2, hit) and b.num_computed_tokens == 8
    assert kv.take_state_copies() == [(snap, b.state_slot)]  # b continues from the snapshot
    c = hybrid_seq([5] * 10)
    c.num_prompt_tokens = 10
    assert not kv.allocate_slots(c, 10)  # the two seats are taken; the third slot is the snapshot's
    kv.free(a)
    assert kv.allocate_slots(c, 8)
    c.num_computed_tokens = 8
    kv.snapshot_state(c)  # one snapshot slot: the older snapshot is evicted and its slot reused
    assert list(kv.snapshots.values()) == [snap] and b.block_hashes[1] not in kv.snapshots
    assert kv.take_state_copies() == [(c.state_slot, snap)]
    d = hybrid_seq(list(range(10)))
    d.num_prompt_tokens = 10
    assert kv.get_computed_blocks(d) == []  # its blocks are cached but their state snapshot is gone
