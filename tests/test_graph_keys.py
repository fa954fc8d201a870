"""Decode-graph keys under tensor parallel (issue 32 item 4): graphs are keyed on what changes the launch, the
attention tiles and KV split count, computed from a rank-identical description of every card (`rank_facts`), so
two ranks capture the same graphs and two identical cards capture exactly what one card does; keying on every
shape (what tensor parallel did before) captured ~120 decode graphs at the defaults."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.planning.graphs import batch_size_ladder
from engine.worker.graphs.decode import context_buckets, triton_split_key
from engine.worker.graphs.dispatch import every_shape

RTX_3090, RTX_4090 = (82, 8), (128, 8)
# Llama-3-8B's attention on each of two cards: 16 query heads, 4 KV heads of 128.
LLAMA_8B_TP2 = SimpleNamespace(attention_layers=lambda: [SimpleNamespace(num_heads=16, num_kv_heads=4, head_dim=128)])


def count_graphs(key, max_num_seqs: int = 256, max_model_len: int = 32768, block_size: int = 16) -> int:
    return sum(len(context_buckets(b, max_model_len, block_size, key)) for b in batch_size_ladder(max_num_seqs))


def test_identical_cards_capture_what_one_card_does():
    one = count_graphs(triton_split_key(LLAMA_8B_TP2, torch.device("cpu"), [RTX_3090]))
    two = count_graphs(triton_split_key(LLAMA_8B_TP2, torch.device("cpu"), [RTX_3090, RTX_3090]))
    finest = count_graphs(every_shape)
    print(f"decode graphs at 256 sequences, 32k context: one 3090 {one}, two 3090s {two}, every shape {finest}")
    assert finest == len(batch_size_ladder(256)) * 6 == 120
    assert two == one and one < finest / 3


def test_mixed_cards_key_on_both_cards_tiles():
    """A 3090 beside a 4090: a length starts a new graph wherever either card's split count changes; both ranks
    compute the same key from the same list."""
    mixed = triton_split_key(LLAMA_8B_TP2, torch.device("cpu"), [RTX_4090, RTX_3090])
    assert triton_split_key(LLAMA_8B_TP2, torch.device("cpu"), [RTX_3090, RTX_4090])(1, 4096) == mixed(1, 4096)
    each = [count_graphs(triton_split_key(LLAMA_8B_TP2, torch.device("cpu"), [card])) for card in (RTX_3090, RTX_4090)]
    assert max(each) <= count_graphs(mixed) <= count_graphs(every_shape)
    for b in batch_size_ladder(256):
        for card in (RTX_3090, RTX_4090):  # every length where this card's launch changes starts a graph
            alone = context_buckets(b, 32768, 16, triton_split_key(LLAMA_8B_TP2, torch.device("cpu"), [card]))
            assert set(alone) <= set(context_buckets(b, 32768, 16, mixed))


@pytest.mark.fake_cuda
def test_the_dispatcher_plans_the_same_graphs_at_tp2_as_on_one_card(tiny_weights, fake_cuda, monkeypatch):  # noqa: F811
    """GraphDispatcher.plan on a (fake) card at tensor parallel 2, every rank reporting the same card: the
    decode and verify graphs of one card, not every shape of the ladder."""
    import engine.worker.graphs.dispatch as dispatch
    from test_fake_cuda import fake_runner
    runner = fake_runner(monkeypatch, fake_cuda, tiny_weights, torch.float16)
    runner.config.max_model_len = 32768  # a long ladder of context lengths (fake tensors: no memory)
    runner.plan_decode_graphs(64, True, 0, 3)
    one_card = ({b: list(c) for b, c in runner.graphs.contexts.items()},
                {b: list(c) for b, c in runner.verify_graphs.contexts.items()})
    monkeypatch.setattr(dispatch, "get_tp_size", lambda: 2)
    monkeypatch.setattr(dispatch, "rank_facts", lambda device: [(8, 8), (8, 8)])
    runner.plan_decode_graphs(64, True, 0, 3)
    assert (runner.graphs.contexts, runner.verify_graphs.contexts) == one_card
    assert sum(map(len, one_card[0].values())) < len(runner.graphs.ladder) * 6  # not every shape of the ladder


def test_rank_facts_are_every_ranks_card_in_rank_order(monkeypatch):
    """Each rank writes its own row and the all-reduce sums the table: the same list on every rank."""
    import engine.worker.graphs.dispatch as dispatch
    import kernels.triton_attention as ta
    tables = []
    monkeypatch.setattr(dispatch, "get_tp_size", lambda: 2)
    monkeypatch.setattr(dispatch, "get_tp_rank", lambda: 1)
    monkeypatch.setattr(ta, "_device_facts", lambda device: RTX_4090)
    monkeypatch.setattr(dispatch, "all_reduce", lambda t: tables.append(t.clone()) or t + torch.tensor([[*RTX_3090],
                                                                                                         [0, 0]]))
    assert dispatch.rank_facts(torch.device("cpu")) == [RTX_3090, RTX_4090]
    assert tables[0].tolist() == [[0, 0], [*RTX_4090]]


@pytest.fixture(scope="module")
def tiny_weights(llama_dir):
    from engine.worker.loader import iterate_weights
    return llama_dir, list(iterate_weights(llama_dir, device="cpu"))


from test_fake_cuda import fake_cuda  # noqa: E402,F401 - the fixture
