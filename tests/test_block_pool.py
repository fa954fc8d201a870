"""BlockPool / KVCacheManager: exact states after each operation, and invariants under random sequences."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.block_pool import NULL_BLOCK, BlockPool
from engine.kv.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from engine.kv.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence
from engine.sample.sampling_params import SamplingParams


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


class FakeSeq(SimpleNamespace):
    table_edits: dict
    mark_table_edit = Sequence.mark_table_edit  # the managers mark in-place table edits for the input batch

    @property
    def block_table(self):
        return self.block_tables[0]


def fake_seq(tokens: list[int]):
    return FakeSeq(token_ids=list(tokens), num_computed_tokens=0, block_tables=[[]], block_hashes=[], table_edits={},
                   request=SimpleNamespace(cache_salt=None, pooling=None),
                   num_cached_blocks=0, num_tokens=len(tokens), params=SamplingParams())


def test_free_queue_is_lru_and_removal_is_from_the_middle():
    pool = BlockPool(6)  # blocks 1..6: block 0 is the reserved null block (issue 32)
    a = pool.get_new_blocks(3)
    assert free_ids(pool) == [4, 5, 6] and [b.ref_count for b in a] == [1, 1, 1]
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [4, 5, 6, 3, 2, 1]
    pool.touch([pool.blocks[5]])  # out of the middle, O(1)
    assert free_ids(pool) == [4, 5, 3, 2, 1] and pool.blocks[5].ref_count == 1
    assert pool.num_free_blocks == 5


def test_block_zero_is_never_handed_out():
    """Issue 32 item 6: NULL_BLOCK is block 0, and every zero-filled table entry (freed rows, graph padding,
    warm-up and capture metadata) points at its page; the pool's blocks are 1..n, so no sequence's KV is ever
    there, however the pool is drained, freed, cached and evicted."""
    from engine.kv.block_pool import NULL_BLOCK, kv_pages
    pool = BlockPool(4)
    assert NULL_BLOCK.block_id == 0 and sorted(b.block_id for b in pool.blocks) == [1, 2, 3, 4]
    for _ in range(3):
        taken = pool.get_new_blocks(4)
        assert 0 not in [b.block_id for b in taken] and pool.num_free_blocks == 0
        pool.free_blocks(taken)
    assert kv_pages(4) == 5  # the KV cache holds page 0 as well


def test_cached_blocks_survive_free_until_reallocated():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    seq = fake_seq(list(range(10)))
    assert kv.allocate_slots(seq, 10)
    seq.num_computed_tokens = 10  # the forward wrote them
    first_two = [b.block_id for b in seq.block_table[:2]]
    kv.free(seq)
    again = fake_seq(list(range(10)))
    hits = kv.get_computed_blocks(again)
    assert [b.block_id for b in hits.blocks[0]] == first_two
    assert kv.allocate_slots(again, 2, hits) and kv.prefix_hits == 8 and kv.prefix_queries == 20
    kv.free(again)
    # Allocating all blocks to other tokens evicts the cached ones.
    other = fake_seq([99] * 16)
    assert kv.allocate_slots(other, 16)
    assert kv.get_computed_blocks(fake_seq(list(range(10)))) == []


def test_fully_cached_prompt_still_recomputes_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    seq = fake_seq(list(range(8)))
    kv.allocate_slots(seq, 8)
    twin = fake_seq(list(range(8)))
    hits = kv.get_computed_blocks(twin)
    assert len(hits) == 1  # the block holding the last token is not reused
    assert kv.allocate_slots(twin, 4, hits) and twin.num_computed_tokens == 4


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    parent = fake_seq(list(range(6)))
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = fake_seq(list(range(6)))
    kv.fork(parent, child)
    assert [b.ref_count for b in parent.block_table] == [2, 2]
    child.token_ids.append(7)
    assert kv.allocate_slots(child, 1)
    (src, dst), = kv.take_copies()
    assert src == parent.block_table[1].block_id and dst == child.block_table[1].block_id != src
    assert child.block_table[0] is parent.block_table[0] and parent.block_table[1].ref_count == 1


operations = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "fork", "preempt"]), st.integers(0, 40)),
                      max_size=60)


FULL4 = FullAttentionSpec(4, 1, 1, 1)
GROUPS = {"one": None, "full+window": [FULL4, SlidingWindowSpec(4, 1, 1, 1, 6)],
          "window": [SlidingWindowSpec(4, 1, 1, 1, 5)],
          "full+2 windows": [FULL4, SlidingWindowSpec(4, 1, 1, 1, 9), SlidingWindowSpec(4, 1, 1, 1, 9)]}


@settings(max_examples=150, deadline=None)
@given(ops=operations, caching=st.booleans(), groups=st.sampled_from(sorted(GROUPS)))
def test_invariants_under_random_operations(ops, caching, groups):
    """Any mix of admissions (with prefix hits), decodes, frees, forks and preemptions, for one group or
    several (window groups freeing blocks): ref counts equal the tables holding each block, free blocks are
    exactly those at zero, a window group's freed entries are a prefix of its table and never a block the
    last step needed, and everything comes back at the end."""
    specs = GROUPS[groups]
    kv = KVCacheManager(num_blocks=12 * (len(specs) if specs else 1), block_size=4, enable_caching=caching,
                        group_specs=specs)
    pool = kv.pool
    live = []
    for op, arg in ops:
        if op == "add":
            seq = fake_seq([arg % 5] * (arg % 13 + 1))
            hits = kv.get_computed_blocks(seq)
            new = seq.num_tokens - len(hits) * 4
            if kv.allocate_slots(seq, new, hits):
                seq.num_computed_tokens = seq.num_tokens
                live.append(seq)
        elif op == "grow" and live:
            seq = live[arg % len(live)]
            seq.token_ids.append(arg)
            seq.num_tokens += 1
            if kv.allocate_slots(seq, 1):
                seq.num_computed_tokens += 1
            else:
                seq.token_ids.pop()
                seq.num_tokens -= 1
        elif op == "free" and live:
            kv.free(live.pop(arg % len(live)))
        elif op == "preempt" and live:  # slots allocated for a chunk, then freed before any forward wrote them
            seq = live.pop(arg % len(live))
            seq.token_ids += [arg % 5] * (arg % 9 + 1)
            seq.num_tokens = len(seq.token_ids)
            if kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens):
                unwritten = [b for t in seq.block_tables for b in t[seq.num_computed_tokens // 4:]]
                kv.free(seq)
                assert all(b.block_hash is None for b in unwritten if b.ref_count == 0)
            else:
                kv.free(seq)
        elif op == "fork" and live:
            parent = live[arg % len(live)]
            child = fake_seq(parent.token_ids)
            kv.fork(parent, child)
            live.append(child)
        kv.take_copies()
        holders: dict[int, int] = {}
        group_of: dict[int, int] = {}
        for seq in live:
            for g, (spec, table) in enumerate(zip(specs or [FULL4], seq.block_tables)):
                assert len(table) == -(-seq.num_computed_tokens // 4)
                nulls = sum(b is NULL_BLOCK for b in table)
                assert all(b is NULL_BLOCK for b in table[:nulls])  # freed entries: a prefix
                if spec.sliding_window is None:
                    assert nulls == 0
                else:  # the next token (position num_computed) reads keys from (num_computed - window + 1) on;
                    # a slot allocation for it frees what lies before, even when the allocation itself fails
                    assert nulls <= max(0, (seq.num_computed_tokens - spec.sliding_window + 1) // 4)
                for b in table[nulls:]:
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
                    assert group_of.setdefault(b.block_id, g) == g, f"{b} is in two groups' tables"
        for b in pool.blocks:
            assert b.ref_count >= 0
            assert b.ref_count == holders.get(b.block_id, 0)  # shared only through ref counts
        used = sum(1 for b in pool.blocks if b.ref_count > 0)
        assert used + pool.num_free_blocks == pool.num_blocks
        assert sorted(free_ids(pool)) == sorted(b.block_id for b in pool.blocks if b.ref_count == 0)
        assert pool.num_cached_free == sum(1 for b in pool.free_queue if b.block_hash is not None)
    for seq in live:
        kv.free(seq)
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)
