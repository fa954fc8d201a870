"""The thread budget (engine/platform/threads.py): one place sizes every computing pool, never above the cores
the process may use, and never over what the user chose."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine.platform import threads


def test_the_budget_follows_the_affinity_and_omp_num_threads(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 6)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.thread_budget() == threads.ThreadBudget(6, 6, 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the router's placement of this engine
    assert threads.thread_budget() == threads.ThreadBudget(2, 2, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "64")  # more than the process may use: the cores win
    assert threads.thread_budget().compute_threads == 6


def test_applying_only_lowers_the_pools(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # someone chose fewer: kept
        monkeypatch.setattr(threads, "available_cores", lambda: 2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        threads.apply_thread_budget()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(3)
        threads.apply_thread_budget()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_environment_is_set_before_torch_loads_and_the_users_values_win():
    code = ("import os, sys; import engine; assert 'torch' not in sys.modules and 'numba' not in sys.modules; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['TOKENIZERS_PARALLELISM'], "
            "int(os.environ['NUMBA_NUM_THREADS']) <= len(os.sched_getaffinity(0)))")

    def run(**env):
        names = ("OMP_WAIT_POLICY", "TOKENIZERS_PARALLELISM", "NUMBA_NUM_THREADS")
        base = {k: v for k, v in os.environ.items() if k not in names}
        done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert run() == ["PASSIVE", "false", "True"]
    assert run(OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "false", "True"]


@pytest.mark.parametrize("value", ["0"])
def test_the_budget_can_be_left_out(monkeypatch, value):
    monkeypatch.setenv("PAGEDESK_THREAD_BUDGET", value)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    threads.set_process_env()
    assert "OMP_WAIT_POLICY" not in os.environ
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "available_cores", lambda: 1)
    threads.apply_thread_budget()
    assert torch.get_num_threads() == before
