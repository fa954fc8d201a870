"""Peer-to-peer is trusted only after a real card-to-card copy arrives intact; the result is cached per pair."""
from __future__ import annotations

import pytest
import torch

from engine.distributed import peer_access
from engine.distributed.peer_access import copy_arrives_intact, nccl_environment, peer_copy_works


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


# ---- issue 19 item 2: the probe runs in a throwaway process and its answer is cached per driver and card ----

def fake_probe_target(pairs):
    """Stands in for probe_pairs in the spawned process: says where it ran, and that only 0->1 works."""
    import os
    from pathlib import Path
    Path(os.environ["PEER_PROBE_MARK"]).write_text(str(os.getpid()))
    return {pair: pair == (0, 1) for pair in pairs}


def failing_probe_target(pairs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def hanging_probe_target(pairs):
    import time
    time.sleep(60)


def test_probe_runs_in_a_throwaway_process(tmp_path, monkeypatch):
    import os
    from engine.distributed.peer_access import probe_in_child
    mark = tmp_path / "probe.pid"
    monkeypatch.setenv("PEER_PROBE_MARK", str(mark))
    assert probe_in_child([(0, 1), (1, 0)], fake_probe_target) == {(0, 1): True, (1, 0): False}
    child = int(mark.read_text())
    assert child != os.getpid()
    assert not os.path.exists(f"/proc/{child}")  # gone, and its CUDA contexts with it


@pytest.mark.parametrize("target,timeout_s,says", [(failing_probe_target, 60, "illegal memory access"),
                                                    (hanging_probe_target, 1, "no answer in 1 s")])
def test_a_failed_or_hung_probe_means_no_p2p(target, timeout_s, says, caplog):
    from engine.distributed.peer_access import probe_in_child
    with caplog.at_level("WARNING", logger="pagedesk.engine"):
        assert probe_in_child([(0, 1), (1, 0)], target, timeout_s=timeout_s) == {(0, 1): False, (1, 0): False}
    assert says in caplog.text


def test_answers_are_cached_per_driver_and_card(tmp_path):
    from engine.distributed.peer_access import PeerAccessCache
    path, probed = tmp_path / "cache" / "peer_access.json", []
    identity = {"driver": "550.54", "uuids": ["GPU-a", "GPU-b", "GPU-c"]}

    def probe(pairs):
        probed.append(sorted(pairs))
        return {pair: pair[0] + pair[1] != 3 for pair in pairs}  # cuda:1 <-> cuda:2 lacks P2P

    def cache(n):
        return PeerAccessCache(n, lambda n: (identity["driver"], identity["uuids"][:n]), probe, path)

    first = cache(3)
    assert probed == [[(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]] and not first(1, 2) and first(0, 2)
    assert nccl_environment(3, cache(3), {}) == {"NCCL_P2P_DISABLE": "1"} and len(probed) == 1  # from the file
    assert cache(2)(0, 1) and len(probed) == 1  # a subset of known cards: still no probe
    identity["uuids"][1] = "GPU-new"  # another card in slot 1: only its pairs are probed
    cache(3)
    assert probed[-1] == [(0, 1), (1, 0), (1, 2), (2, 1)]
    identity["driver"] = "560.35"  # a new driver: everything again
    cache(2)
    assert probed[-1] == [(0, 1), (1, 0)]
    path.write_text("{not json")
    assert cache(2)(0, 1) and probed[-1] == [(0, 1), (1, 0)] and len(probed) == 4


def test_executor_never_probes_on_the_engine_process(monkeypatch):
    """The executor asks the cache (a probe process), never peer_copy_works in its own process."""
    from engine.executor import tp_executor as executor
    monkeypatch.setattr(peer_access, "peer_copy_works", lambda a, b: 1 / 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(executor.gpu_baseline, "record", lambda i: None)
    monkeypatch.setattr(executor, "PeerAccessCache", lambda n: (lambda a, b: False))
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    env = executor.TensorParallelExecutor._prepare_devices(torch.device("cuda", 0), 2)
    assert env == {"NCCL_P2P_DISABLE": "1"}
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    monkeypatch.setattr(executor, "PeerAccessCache", lambda n: 1 / 0)  # the user's setting: no probe at all
    assert executor.TensorParallelExecutor._prepare_devices(torch.device("cuda", 0), 2) == {}
