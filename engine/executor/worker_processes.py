"""The worker processes of a tensor-parallel group: spawning them, watching their health, and ending them.

`spawn_worker` starts one rank (engine/executor/tp_worker.py) with two one-way OS pipes (commands in, results
out; never a socket) and a shared heartbeat counter. `watch_workers` runs on its own thread: it logs a worker's
death the moment its process ends, and a worker whose heartbeat stopped for HEARTBEAT_TIMEOUT_S (SIGSTOP, a hung
card) however long the step, and marks the executor so its next call fails with the cause. `describe_failure`
says why a worker failed (its error report, or how its process ended). `GroupResources` is what must be
released however the executor ends (shutdown, failure, garbage collection, interpreter exit): the workers
(joined, then killed), the rendezvous store folder and this process's membership of the group. The store folder
is named after this process's pid; `remove_stale_store_dirs` removes those of processes that died without
cleanup. It never runs a step: the per-step fan-out is the executor's (engine/executor/tp_executor.py).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from engine.distributed.parallel_state import destroy_distributed
from engine.distributed.step_ring import StepReader
from engine.executor.tp_worker import WorkerSpec, worker_main

logger = logging.getLogger("pagedesk.engine")
POLL_S = 0.25
HEARTBEAT_TIMEOUT_S = 5.0  # no beat for this long: the worker is stopped (its beats come every 0.5 s)
STORE_PREFIX = "pagedesk-tp-"  # + owner pid + "-": the rendezvous store folder of one engine process


def remove_stale_store_dirs(tmp_dir: str | None = None) -> list[str]:
    """Remove rendezvous folders left by engine processes that no longer run (a SIGKILL skips every cleanup);
    returns what was removed. Folders of live processes, and names not ours, are left alone."""
    tmp_dir = tmp_dir or tempfile.gettempdir()
    removed = []
    for name in os.listdir(tmp_dir):
        owner = name[len(STORE_PREFIX):].split("-", 1)[0]
        if not name.startswith(STORE_PREFIX) or not owner.isdigit() or _pid_alive(int(owner)):
            continue
        shutil.rmtree(os.path.join(tmp_dir, name), ignore_errors=True)
        removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


@dataclass
class WorkerProcess:
    rank: int
    process: mp.process.BaseProcess
    commands: Connection  # rank 0 -> worker: (method, args)
    results: Connection  # worker -> rank 0: ("ok", result) | ("error", traceback)
    heartbeat: Any = None  # shared RawValue("Q") the worker's heartbeat thread counts up


def spawn_worker(ctx, spec: WorkerSpec, ring: StepReader) -> WorkerProcess:
    """Start rank `spec.rank` with its pipes, its heartbeat and its end of the step ring."""
    # Two one-way OS pipes (not a socketpair): commands in, results out.
    command_reader, command_writer = ctx.Pipe(duplex=False)
    result_reader, result_writer = ctx.Pipe(duplex=False)
    heartbeat = ctx.RawValue("Q", 0)
    process = ctx.Process(target=worker_main, name=f"pagedesk-tp-rank{spec.rank}", daemon=True,
                          args=(spec, command_reader, result_writer, heartbeat, ring))
    process.start()
    command_reader.close()  # the worker's ends: closed here, so its death shows as EOF
    result_writer.close()
    return WorkerProcess(spec.rank, process, command_writer, result_reader, heartbeat)


def describe_failure(w: WorkerProcess, activity: str) -> str:
    """Why worker `w` failed while doing `activity`: its error report if it sent one, else how it ended."""
    try:
        if w.results.poll():
            status, payload = w.results.recv()
            if status == "error":
                return f"tensor-parallel worker rank {w.rank} failed while {activity}:\n{payload}"
    except (EOFError, OSError):
        pass
    w.process.join(timeout=1.0)
    code = w.process.exitcode
    if code is None:
        how = "stopped answering"
    elif code < 0:
        how = f"died (killed by {signal.Signals(-code).name})"
    else:
        how = f"died (exit code {code})"
    hint = " — the out-of-memory killer is the usual suspect (see `dmesg`)" if code == -signal.SIGKILL else ""
    return (f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) {how} while {activity}{hint}; "
            "the engine cannot continue without it and has stopped every rank; restart the engine")


@dataclass
class GroupResources:
    """What must be released however the executor ends: shutdown, failure, garbage collection or exit."""

    workers: list[WorkerProcess] = field(default_factory=list)
    store_dir: tempfile.TemporaryDirectory = field(
        default_factory=lambda: tempfile.TemporaryDirectory(prefix=f"{STORE_PREFIX}{os.getpid()}-"))
    joined: bool = False  # this process joined torch.distributed for this group
    watch_stop: Connection | None = None  # closing it wakes the watch thread
    released: bool = False  # workers ended on purpose: not news for the watch thread

    def release(self, grace_s: float = 0.5, abort: bool = False) -> None:
        """Join the workers, then SIGKILL whatever is left; leave the group; remove the store."""
        self.released = True
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.process.is_alive():  # workers ignore SIGTERM: only a kill ends one that did not leave
                w.process.kill()
                w.process.join(timeout=2.0)
            logger.info("tensor-parallel worker rank %d (pid %s) ended with exit code %s", w.rank, w.process.pid,
                        w.process.exitcode)
            w.commands.close()
            w.results.close()
        if self.watch_stop is not None:
            self.watch_stop.close()
        self.store_dir.cleanup()
        if self.joined:
            self.joined = False
            destroy_distributed(abort=abort)


def watch_workers(executor_ref: weakref.ref, resources: GroupResources, stop: Connection,
                  timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
    """Log a worker's death the moment it happens, and a worker whose heartbeat stopped for `timeout_s`,
    even while idle; the executor's next call then fails with the cause. Waits on the sentinels only (reaping
    and the pipes stay with the engine's thread) and holds no strong reference to the executor, so garbage
    collection can still end the group."""
    by_sentinel = {w.process.sentinel: w for w in resources.workers}
    last = {w.rank: (w.heartbeat.value if w.heartbeat is not None else 0, time.monotonic()) for w in resources.workers}
    while True:
        ready = wait([*by_sentinel, stop], timeout=min(POLL_S * 2, timeout_s / 4))
        if stop in ready or resources.released:
            return
        ended = [by_sentinel[s] for s in ready if s in by_sentinel]
        executor = executor_ref()
        if executor is None:
            return
        if ended:
            executor.worker_exited = ended[0]
            logger.error("tensor-parallel worker rank %d (pid %d) exited; the engine fails on its next call",
                         ended[0].rank, ended[0].process.pid)
            return
        now = time.monotonic()
        for w in resources.workers:
            if w.heartbeat is None:
                continue
            count, since = last[w.rank]
            if w.heartbeat.value != count:
                last[w.rank] = (w.heartbeat.value, now)
            elif now - since > timeout_s and executor.worker_stalled is None:
                executor.worker_stalled = (f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) has sent no "
                                     f"heartbeat for {now - since:.0f} s: it is stopped (SIGSTOP, a debugger) or "
                                     "its card hangs; the engine cannot run a step without it; restart the engine")
                logger.error(executor.worker_stalled)
        del executor
