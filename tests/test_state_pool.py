"""The hybrid models' state pool (engine/state_pool.py) behind KVCacheManager: exact behaviour of admission,
forks and frees, and under random operations no slot leaked and no slot shared without a copy.

The hypothesis test models what each slot holds as the tokens its state summarises: a forward checks that a
sequence continuing its state finds exactly its own history in its slot (forks get theirs through the pending
copies, applied all at once before the forward), then writes its new history there.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache_manager import KVCacheManager
from engine.state_pool import StatePool
from test_block_pool import fake_seq


def hybrid_seq(tokens):
    seq = fake_seq(tokens)
    seq.state_slot = None
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
@given(ops=operations)
def test_no_slot_leaked_and_none_shared_without_a_copy(ops):
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False, num_state_slots=5)
    held: dict[int, tuple] = {}  # slot -> the tokens its state summarises
    live = []

    def forward(steps):
        """One step: pending fork copies first (all at once), then each scheduled sequence's layer reads its
        slot (when it continues a state) and writes its new history."""
        before = dict(held)
        for src, dst in kv.take_state_copies():
            held[dst] = before.get(src)
        for seq, computed in steps:
            if computed:
                assert held.get(seq.state_slot) == tuple(seq.token_ids[:computed]), "a slot another sequence wrote"
            seq.num_computed_tokens = seq.num_tokens
            held[seq.state_slot] = tuple(seq.token_ids)

    for op, arg in ops:
        if op == "add":
            seq = hybrid_seq([arg % 7] * (arg % 9 + 1))
            if kv.allocate_slots(seq, seq.num_tokens):
                live.append(seq)
                forward([(seq, 0)])
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
        slots = [s.state_slot for s in live]
        assert None not in slots and len(set(slots)) == len(slots)  # one slot each, never two holders
        assert kv.state.pool.held() == set(slots)  # nothing leaked
    for seq in live:
        kv.free(seq)
    assert kv.state.pool.num_used == 0 and kv.pool.num_free_blocks == kv.pool.num_blocks
