"""Peer-to-peer is trusted only after a real card-to-card copy arrives intact; the result is cached per pair."""
from __future__ import annotations

import torch

from engine import peer_access
from engine.peer_access import copy_arrives_intact, nccl_environment, peer_copy_works


def test_copy_check_compares_what_arrived():
    assert copy_arrives_intact("cpu", "cpu")


def test_claimed_peer_access_with_a_corrupting_copy_disables_nccl_p2p(monkeypatch, caplog):
    peer_copy_works.cache_clear()
    copies = []
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)  # the driver says yes...
    monkeypatch.setattr(peer_access, "copy_arrives_intact", lambda a, b: copies.append((a, b)) or a != "cuda:1")
    with caplog.at_level("WARNING", logger="pagedesk.engine"):
        assert nccl_environment(2, peer_copy_works, {}) == {"NCCL_P2P_DISABLE": "1"}  # ...the copy says no
        nccl_environment(2, peer_copy_works, {})
    assert copies == [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")]  # each pair tested once
    assert "peer copy cuda:1->cuda:0 delivered different data" in caplog.text
    peer_copy_works.cache_clear()


def test_no_claimed_access_skips_the_copy(monkeypatch):
    peer_copy_works.cache_clear()
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    monkeypatch.setattr(peer_access, "copy_arrives_intact", lambda a, b: 1 / 0)
    assert not peer_copy_works(0, 1)
    peer_copy_works.cache_clear()
