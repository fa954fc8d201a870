"""A tensor-parallel worker process: rank 1.. of the group, holding its shard of the model and KV cache.

Spawned by the executor. It first arranges to die with its parent, joins the torch.distributed group,
builds its ModelRunner, then loops on two inputs. Forward steps (`StepInputs`, the block tables as a diff)
come through the shared-memory step ring (engine/distributed/step_ring.py) and are run in lock step with rank 0 (the
collectives inside the forward pair up) with no answer, so rank 0 never waits for an acknowledgement and
can write the next step while this one runs. Every other command comes over the command pipe, names a
ModelRunner method and its arguments and the last step published before it (run first), and is answered
on the result pipe with ("ok", result) or ("error", traceback); a step's error also goes there. It never
samples: `run` gets no sampling batch, so logits are computed (every rank must join the LM head's
all-gather) and dropped. Pipe EOF, a "shutdown" command, its own error, or its parent's death ends it.

It ignores SIGINT and SIGTERM: a GUI stops an engine by signalling its whole process group, and a worker
that died then would leave rank 0's last all-reduce waiting; instead rank 0 drains and sends "shutdown".
A heartbeat thread bumps a shared counter every HEARTBEAT_S, apart from the command loop, so rank 0 can
tell a stopped worker (SIGSTOP, a hung card) from a slow step; on CUDA each beat first waits for a tiny
kernel on a side stream, so a card that stopped running work stops the beats too (skipped while the command
loop captures CUDA graphs, when another thread's CUDA calls would break the capture).
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.worker import gpu_baseline
from engine.config.model import ModelConfig
from engine.distributed.parent_watch import die_with_parent
from engine.distributed.step_ring import StepReader

# ModelRunner methods rank 0 may ask for over the pipe (forward steps come through the ring, unanswered).
COMMANDS = ("reserve_input_rows", "reserve_verify_tokens", "allocate_kv_cache", "profile_memory", "weights_bytes",
            "kv_cache_bytes", "plan_decode_graphs", "capture_decode_graphs", "allocate_kv_offload", "transfer_kv", "sleep",
            "wake_up", "set_cpu_linear")
CAPTURES = frozenset({"capture_decode_graphs", "wake_up"})  # commands during which the heartbeat must not touch the card
HEARTBEAT_S = 0.5
WAKE_POLL_S = 0.1  # an idle worker's sleep between looks at its pipe (rank 0's wake-up ends it early)


@dataclass
class WorkerSpec:
    """Everything a worker needs to rebuild its rank of the engine; plain, picklable data."""

    rank: int
    world_size: int
    dist_backend: str  # "gloo" | "nccl"
    store_path: str  # FileStore for rendezvous, in a per-engine temporary folder
    timeout_s: float
    parent_pid: int
    model_config: ModelConfig
    model_path: Path
    device_type: str
    dtype: torch.dtype
    block_size: int
    attention_backend: str
    env: dict[str, str] = field(default_factory=dict)  # set before torch.distributed starts (NCCL_P2P_DISABLE)


def worker_main(spec: WorkerSpec, commands: Connection, results: Connection, heartbeat=None,
                ring: StepReader | None = None) -> None:
    """`heartbeat`: a shared multiprocessing RawValue("Q") the heartbeat thread keeps counting up; `ring`: this
    worker's end of the step ring (engine/distributed/step_ring.py)."""
    die_with_parent(spec.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when this worker ends
        signal.signal(sig, signal.SIG_IGN)
    card_lock = threading.Lock()  # held by the command loop while it captures CUDA graphs
    card_ready = threading.Event()  # the probe's context only after the KV baseline was read (gpu_baseline)
    if heartbeat is not None:
        device = torch.device("cuda", spec.rank) if spec.device_type == "cuda" else None
        threading.Thread(target=beat, args=(heartbeat, device, card_lock, card_ready), name="pagedesk-tp-heartbeat",
                         daemon=True).start()
    os.environ.update(spec.env)
    torch.set_num_threads(1)  # the cards do the work; CPU runs (tests) share a few cores between ranks
    from engine.distributed.parallel_state import destroy_distributed, init_distributed
    from engine.worker.model_runner import ModelRunner
    try:
        device = torch.device("cpu")
        if spec.device_type == "cuda":
            device = torch.device("cuda", spec.rank)
            gpu_baseline.record(spec.rank)  # before set_device makes this process's context
            torch.cuda.set_device(device)
        init_distributed(spec.rank, spec.world_size, spec.dist_backend, spec.store_path, spec.timeout_s)
        runner = ModelRunner(spec.model_config, spec.model_path, device, spec.dtype, spec.block_size,
                             spec.attention_backend)
        card_ready.set()
        results.send(("ok", runner.weights_bytes()))
    except BaseException:
        _reply_error(results)
        _exit(1)
    code = serve(runner, commands, results, card_lock, ring)
    if code == 0:
        destroy_distributed()
    _exit(code)


def beat(counter, device: torch.device | None, card_lock: threading.Lock, card_ready: threading.Event,
         period_s: float = HEARTBEAT_S) -> None:
    """Count up forever; with a card (once `card_ready`), only after a tiny kernel on a side stream has
    finished on it."""
    probe = None
    while True:
        if device is not None and card_ready.is_set() and card_lock.acquire(blocking=False):
            try:
                probe = probe or _CardProbe(device)
                probe.wait()  # blocks for as long as the card runs nothing: the beats stop with it
            except Exception:  # noqa: BLE001 - a card that errors is no healthier than one that hangs
                return
            finally:
                card_lock.release()
        counter.value += 1
        time.sleep(period_s)


class _CardProbe:
    """One int32 on the card and a side stream: each wait adds 1 to it there and waits for that to finish."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self.stream):
            self.value = torch.zeros(1, dtype=torch.int32, device=device)
        self.done = torch.cuda.Event()

    def wait(self) -> None:
        with torch.cuda.stream(self.stream):
            self.value.add_(1)
            self.done.record(self.stream)
        self.done.synchronize()


def serve(runner, commands: Connection, results: Connection, card_lock: threading.Lock | None = None,
          ring: StepReader | None = None) -> int:
    """Answer rank 0 until it says shutdown (0), goes away or a command fails (1): forward steps from the
    ring (or, too large for a slot, from the pipe), run without an answer, and commands from the pipe, each
    after the steps published before it, answered once done."""
    card_lock = card_lock or threading.Lock()
    while True:
        if ring is not None:
            payload = ring.take()
            if payload is not None:
                if not _run_step(runner, pickle.loads(payload), ring, results):
                    return 1
                continue
        try:
            if ring is not None and not commands.poll():
                ring.sleep(WAKE_POLL_S)  # rank 0 wakes it; the timeout only bounds how late a closed pipe is seen
                continue
            method, args, published = commands.recv()
        except (EOFError, OSError):  # rank 0 is gone
            return 1
        while ring is not None and ring.next_seq <= published:  # the steps sent before this message first
            payload = ring.take()
            if payload is None or not _run_step(runner, pickle.loads(payload), ring, results):
                if payload is None:
                    _reply_text(results, f"step {ring.next_seq} was sent before {method!r} but is not in the ring")
                return 1
        if method == "shutdown":
            return 0
        if method == "run_step":  # a step too large for a ring slot: it is the next step
            if not _run_step(runner, args[0], ring, results):
                return 1
            continue
        try:
            assert method in COMMANDS, f"unknown command {method!r}"
            if method in CAPTURES:
                with card_lock:
                    result = getattr(runner, method)(*args)
            else:
                result = getattr(runner, method)(*args)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)  # the answer means "done", so rank 0 can trust it
            results.send(("ok", result))
        except BaseException:
            _reply_error(results)
            return 1


def _run_step(runner, inputs, ring: StepReader | None, results: Connection) -> bool:
    """One forward in lock step with rank 0, with no answer (its collectives are the synchronisation; an error
    goes to rank 0 on the result pipe and ends this worker, which breaks rank 0's next collective)."""
    if ring is not None:
        ring.done()  # read: its slot may take the step after next
    try:
        runner.run(inputs)
        return True
    except BaseException:
        _reply_error(results)
        return False


def _reply_text(results: Connection, message: str) -> None:
    try:
        results.send(("error", message))
    except (OSError, EOFError):
        pass


def _reply_error(results: Connection) -> None:
    try:
        results.send(("error", traceback.format_exc()))
    except (OSError, EOFError):
        pass


def _exit(code: int) -> None:
    """Leave at once: interpreter teardown takes seconds with torch loaded, and a failed rank's peers are
    waiting for its sockets to close. Nothing is left to flush but stdio."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
