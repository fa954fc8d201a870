"""The process's thread budget: how many threads each computing pool may run, decided in this one place so that
the engine's pools never oversubscribe the cores the process is given.

The pools are torch's intra-op OpenMP pool (MKL runs on it), numba's (the CPU decode attention), the Rust
tokenizer's and the server's tokenizing threads. A step runs its ops one after another, so the engine's pools
take turns and each may use every core, provided an idle pool sleeps: OpenMP's default keeps a finished op's
threads spinning for milliseconds, which on a busy machine takes the cores the next op, numba's pool or another
program need, and a parallel op whose threads were descheduled waits a time slice at its barrier (issue 39: six
streams gave less than one). So OpenMP waits passively, torch runs no inter-op pool (the engine never runs two
ops at once), and the tokenizer's own pool stays off (the engine and the server tokenize on their own threads).
The environment part (numba's pool size included: asking numba for it would start the pool, maybe on a threading
layer the CPU attention does not want) must be in place before torch and numba load: `engine/__init__.py` calls
`set_process_env` first. Anything the user set wins: environment values are defaults only, and
`apply_thread_budget` only ever lowers torch's pool. `PAGEDESK_THREAD_BUDGET=0` leaves every pool at its library default (the bench's comparison).
Torch-free at import.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
MAX_SERVER_THREADS = 4  # tokenizing helpers of the HTTP server: short jobs beside the engine's step


@dataclass(frozen=True, slots=True)
class ThreadBudget:
    cores: int  # CPUs this process may run on (its affinity, or OMP_NUM_THREADS when set)
    compute_threads: int  # torch's intra-op pool and numba's, which take turns
    server_threads: int  # the server's tokenizing threads


def enabled() -> bool:
    return os.environ.get("PAGEDESK_THREAD_BUDGET", "1") != "0"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def thread_budget() -> ThreadBudget:
    cores = available_cores()
    asked = os.environ.get("OMP_NUM_THREADS", "")
    if asked.isdigit() and int(asked) > 0:  # set by the router's placement, or by the user
        cores = min(cores, int(asked))
    return ThreadBudget(cores, cores, max(1, min(MAX_SERVER_THREADS, cores)))


def set_process_env() -> None:
    """The environment part of the budget; read by OpenMP and the tokenizer when they start (before torch loads)."""
    if enabled():
        for name, value in {**ENV_DEFAULTS, "NUMBA_NUM_THREADS": str(thread_budget().compute_threads)}.items():
            os.environ.setdefault(name, value)


def apply_thread_budget() -> ThreadBudget:
    """Cap torch's pool at the budget (a smaller size someone chose is kept); numba's was sized by the
    environment."""
    budget = thread_budget()
    if not enabled():
        return budget
    import torch
    if torch.get_num_threads() > budget.compute_threads:
        torch.set_num_threads(budget.compute_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already started (or set) in this process: it stays as it is
        pass
    return budget
