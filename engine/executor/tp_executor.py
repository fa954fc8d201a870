"""Executors: what LLMEngine calls `self.runner` — one ModelRunner, or rank 0 of a tensor-parallel group.

`create_executor` returns the plain ModelRunner for one device. For tensor_parallel_size N it returns a
`TensorParallelExecutor`, which owns rank 0's ModelRunner (in this process) and N-1 spawned worker processes
(engine/executor/tp_worker.py; spawned, watched and ended by engine/executor/worker_processes.py), and offers
the ModelRunner methods the engine uses. Each step rank 0 prepares the flat `StepInputs` once (block tables as
a diff of the persistent input batch), publishes them in a shared-memory ring (engine/distributed/step_ring.py)
and runs its own forward — tensors meet in the layers' torch.distributed collectives (gloo on CPU, NCCL on
CUDA) — with no acknowledgement from the workers: the collectives keep the ranks in step. Control (setup,
profiling, graph capture, shutdown) and the workers' errors go over two one-way OS pipes per worker, and a
command's answer is awaited while watching the worker processes, so a dead worker becomes a clear RuntimeError
within about a second, never a hang (during a step: rank 0's collective fails and the worker's pipe or exit
code explains it). A worker whose heartbeat stopped (SIGSTOP, a hung card) is reported by `liveness_problem`
to the server's watchdog, which turns /health 503 and ends the group. Shutdown, garbage collection and
interpreter exit all end the workers: a "shutdown" command after rank 0's last step (workers ignore
SIGINT/SIGTERM, so a signal to the process group cannot cut a step short), then SIGKILL after a grace period;
the workers end themselves if this process dies (engine/distributed/parent_watch.py).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import weakref
from multiprocessing.connection import wait
from typing import Any, Callable

import torch

from engine.distributed.parallel_state import init_distributed
from engine.multimodal.inputs import ProfileImage
from engine.worker import gpu_baseline
from engine.config.model import ModelConfig
from engine.worker.model_runner import ModelRunner
from engine.distributed.peer_access import PeerAccessCache, nccl_environment
from engine.distributed.step_ring import StepRing
from engine.executor.tp_worker import WorkerSpec
from engine.executor.worker_processes import POLL_S, GroupResources, WorkerProcess, describe_failure, \
    remove_stale_store_dirs, spawn_worker, watch_workers

logger = logging.getLogger("pagedesk.engine")

# Bounds rendezvous and every collective. A dead worker is noticed far sooner (through its process);
# this only ends waits on a worker that is alive but stuck. Generous: first-step kernel compilation.
DIST_TIMEOUT_S = 300.0
# After rank 0's own forward fails, how long to wait for a worker's exit or error report to explain it.
FAILURE_GRACE_S = 3.0
STOP_GRACE_S = 5.0
ACTIVITY = {"load": "loading its weights", "run": "running a forward step", "profile_memory": "profiling memory",
            "allocate_kv_cache": "allocating its KV cache", "join": "joining the tensor-parallel group",
            "plan_decode_graphs": "preparing CUDA graphs", "capture_decode_graphs": "capturing CUDA graphs",
            "allocate_kv_offload": "allocating its CPU-RAM KV tier", "transfer_kv": "copying KV to or from the tier",
            "sleep": "going to sleep", "wake_up": "waking up",
            "set_cpu_linear": "compiling its CPU linear kernels"}


def create_executor(model_config: ModelConfig, model_path, device: torch.device, dtype: torch.dtype,
                    block_size: int, attention_backend: str, tensor_parallel_size: int = 1):
    if tensor_parallel_size == 1:
        return ModelRunner(model_config, model_path, device, dtype, block_size, attention_backend)
    return TensorParallelExecutor(model_config, model_path, device, dtype, block_size, attention_backend,
                                  tensor_parallel_size)


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Fail before spawning anything when the model cannot be split `tp` ways."""
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} key/value heads (nor is it a multiple of them)")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if problems:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {', '.join(problems)}; "
                         "choose a tensor-parallel size that divides the attention heads")


class TensorParallelExecutor:
    def __init__(self, model_config: ModelConfig, model_path, device: torch.device, dtype: torch.dtype,
                 block_size: int, attention_backend: str, size: int) -> None:
        check_tensor_parallel(model_config, size)
        if torch.distributed.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel engine (one per process); shut it "
                               "down first")
        self.size, self.failure, self._closed = size, None, False
        self.worker_exited: WorkerProcess | None = None  # set by the watch thread the moment a worker process ends
        self.worker_stalled: str | None = None  # set by the watch thread when a worker's heartbeat stops
        self.dist_backend = "nccl" if device.type == "cuda" else "gloo"
        env = self._prepare_devices(device, size)
        remove_stale_store_dirs()
        self.device = torch.device("cuda", 0) if device.type == "cuda" else device
        self._resources = GroupResources()
        self.workers = self._resources.workers
        self._finalizer = weakref.finalize(self, self._resources.release)  # garbage collection, interpreter exit
        store_path = os.path.join(self._resources.store_dir.name, "rendezvous")
        ctx = mp.get_context("spawn")
        self.ring = StepRing(ctx, size - 1)  # forward steps: shared memory, no answers
        for rank in range(1, size):
            spec = WorkerSpec(rank, size, self.dist_backend, store_path, DIST_TIMEOUT_S, os.getpid(), model_config,
                              model_path, device.type, dtype, block_size, attention_backend, env)
            self.workers.append(spawn_worker(ctx, spec, self.ring.reader(rank - 1)))
        try:
            self._watch(lambda: init_distributed(0, size, self.dist_backend, store_path, DIST_TIMEOUT_S), "join")
            self._resources.joined = True
            self.runner = ModelRunner(model_config, model_path, self.device, dtype, block_size, attention_backend)
            self.worker_weights_bytes = self._gather("load")  # each worker's shard, for logs and tests
        except BaseException:
            self.shutdown()
            raise
        stop_reader, self._resources.watch_stop = ctx.Pipe(duplex=False)
        threading.Thread(target=watch_workers, args=(weakref.ref(self), self._resources, stop_reader),
                         name="pagedesk-tp-watch", daemon=True).start()
        logger.info("tensor parallel over %d ranks (%s): worker pids %s", size, self.dist_backend, self.worker_pids)

    @staticmethod
    def _prepare_devices(device: torch.device, size: int) -> dict[str, str]:
        if device.type != "cuda":
            return {}
        if torch.cuda.device_count() < size:
            raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs but {torch.cuda.device_count()} "
                             "are visible; lower --tensor-parallel-size or check CUDA_VISIBLE_DEVICES")
        if "NCCL_P2P_DISABLE" in os.environ:
            env = {}  # the user's choice: no probe
        else:  # probed in a throwaway process (no context of ours on the other cards), cached per driver and card
            env = nccl_environment(size, PeerAccessCache(size), os.environ)
        os.environ.update(env)  # rank 0 too, before its NCCL starts
        gpu_baseline.record(0)  # before set_device makes this process's context
        torch.cuda.set_device(0)
        return env

    # ---- what LLMEngine and the KV sizing call ----------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def execute(self, batch, block_copies: list[tuple[int, int]], sampling=None, state_copies=(), kv_transfers=None,
                encoder=None):
        """Every rank runs the forward (and its images' encoding); rank 0 alone samples (workers compute logits
        for the all-gather). The CPU-RAM tier's copies ride in the step's inputs: every rank moves its own shard."""
        self._ensure_usable()
        inputs = self.runner.prepare(batch, block_copies, state_copies, encoder)
        inputs.kv_transfers = kv_transfers
        return self._run_step(inputs, sampling)

    def allocate_kv_offload(self, num_blocks: int, num_state_slots: int = 0) -> int:
        return self._run_everywhere("allocate_kv_offload", num_blocks, num_state_slots)[0]

    def transfer_kv(self, transfers) -> None:
        """A batch of tier copies outside a step (every rank queues its own; a worker answers once issued, on a
        card once the card is idle: rare, only steps that run no forward come here)."""
        self._run_everywhere("transfer_kv", transfers)

    def kv_transfers_done(self) -> int:
        return self.runner.kv_transfers_done()  # rank 0's queue; each worker fences on its own before a forward

    def wait_kv_transfers(self, batch: int, timeout: float) -> bool:
        return self.runner.wait_kv_transfers(batch, timeout)

    def sleep(self, level: int) -> dict[str, int]:
        return self._run_everywhere("sleep", level)[0]  # rank 0's bytes; every rank frees its own shard

    def wake_up(self) -> None:
        self._run_everywhere("wake_up")  # every rank captures its graphs again: their all-reduces pair up

    def set_cpu_linear(self, name: str) -> None:
        self._run_everywhere("set_cpu_linear", name)

    def reserve_input_rows(self, max_num_seqs: int) -> None:
        self._run_everywhere("reserve_input_rows", max_num_seqs)

    def reserve_draft_rows(self, max_drafts: int) -> None:
        self.runner.reserve_draft_rows(max_drafts)  # rank 0 counts the expert load: every rank routes alike

    def reserve_verify_tokens(self, num_tokens: int) -> None:
        self._run_everywhere("reserve_verify_tokens", num_tokens)

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype, num_state_slots: int = 0) -> None:
        self._run_everywhere("allocate_kv_cache", num_blocks, kv_dtype, num_state_slots)

    def profile_memory(self, num_tokens: int, max_num_seqs: int, kv_dtype: torch.dtype,
                       num_speculative_tokens: int = 0, image: ProfileImage | None = None) -> list:
        """Every rank's MemoryProfile, rank order; the caller sizes the pool by the card with least room (every
        rank makes and encodes `image` from its size: the towers are replicated)."""
        local, remote = self._run_everywhere("profile_memory", num_tokens, max_num_seqs, kv_dtype,
                                             num_speculative_tokens, image)
        return local + [p for profiles in remote for p in profiles]

    def weights_bytes(self) -> int:
        return self.runner.weights_bytes()  # per card; every rank holds a same-sized shard

    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes()

    def expert_load_totals(self) -> dict | None:
        return self.runner.expert_load_totals()  # rank 0 counts: every rank routes the same tokens

    def graph_bytes(self) -> int:
        return self.runner.graph_bytes()

    def plan_decode_graphs(self, max_batch: int, capture: bool = True, piecewise_tokens: int = 0,
                           verify_query_len: int = 0) -> None:
        self._run_everywhere("plan_decode_graphs", max_batch, capture, piecewise_tokens, verify_query_len)

    def capture_decode_graphs(self) -> None:
        self._run_everywhere("capture_decode_graphs")  # every rank captures: NCCL all-reduces live in the graphs

    # ---- lock-step calls --------------------------------------------------------------------------------

    def _run_step(self, inputs, sampling) -> Any:
        """Publish the step in the ring (or, too large for a slot, send it over the pipes) and wake the
        workers, then run rank 0's forward and sampling; no worker answers. A worker that failed or died
        shows as rank 0's collective failing (explained from its pipe or exit code), or to the watch thread."""
        self._ensure_usable()
        self._check_workers_alive()
        payload = pickle.dumps(inputs, protocol=pickle.HIGHEST_PROTOCOL)
        seq = self.ring.publish(payload, self._check_workers_alive)
        if seq is None:
            self._send_all("run_step", (inputs,), self.ring.seq - 1)
        self.ring.wake()
        try:
            return self.runner.run(inputs, sampling)
        except Exception as exc:
            raise self._explain_local_failure(exc, "run") from exc

    def _check_workers_alive(self, method: str = "run") -> None:
        for w in self.workers:
            if not w.process.is_alive():  # don't walk into a collective with a dead peer
                raise self._fail(self._describe_failure(w, method))

    def _send_all(self, method: str, args: tuple, published: int) -> None:
        """A pipe message to every worker, naming the last ring step published before it."""
        self._check_workers_alive(method)
        for w in self.workers:
            try:
                w.commands.send((method, args, published))
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise self._fail(self._describe_failure(w, method))

    def _run_everywhere(self, method: str, *args: Any, rank0_args: tuple = ()) -> tuple[Any, list[Any]]:
        """Start `method` on every worker, run it on rank 0 (with `rank0_args` appended: what stays in this
        process, like the sampling batch), then collect the workers' answers."""
        self._ensure_usable()
        self._send_all(method, args, self.ring.seq)
        self.ring.wake()
        try:
            local = getattr(self.runner, method)(*args, *rank0_args)
        except Exception as exc:
            raise self._explain_local_failure(exc, method) from exc
        return local, self._gather(method)

    def kill_workers(self) -> None:
        """SIGKILL every worker; safe from any thread. For a watchdog whose step is stuck in a collective on a
        worker that stopped answering: with the worker gone the collective fails and the step raises."""
        for w in self.workers:
            if w.process.pid is not None and w.process.is_alive():
                try:
                    os.kill(w.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def check_health(self) -> None:
        """Raise RuntimeError if a worker has died or stopped (even while the engine sat idle)."""
        if self.worker_stalled is not None and self.failure is None:
            raise self._fail(self.worker_stalled)
        self._ensure_usable()

    def liveness_problem(self) -> str | None:
        """Why the group cannot run a step because a worker stopped beating, or None; safe from any thread and
        answers at once even while a step is stuck in a collective. (A worker that exited fails the engine's
        next call with its exit code.)"""
        return self.worker_stalled

    def _ensure_usable(self) -> None:
        if self.worker_exited is not None and self.failure is None:
            raise self._fail(self._describe_failure(self.worker_exited, "waiting for the next step"))
        if self.failure is not None:
            raise RuntimeError(f"the tensor-parallel group has already failed: {self.failure}")
        if self._closed:
            raise RuntimeError("the tensor-parallel group was shut down")

    def _gather(self, method: str) -> list[Any]:
        return [self._receive(w, method) for w in self.workers]

    def _receive(self, w: WorkerProcess, method: str) -> Any:
        deadline = time.monotonic() + DIST_TIMEOUT_S
        while True:
            ready = wait([w.results, w.process.sentinel], timeout=POLL_S)
            if w.results in ready:
                try:
                    status, payload = w.results.recv()
                except (EOFError, OSError):
                    raise self._fail(self._describe_failure(w, method))
                if status == "ok":
                    return payload
                raise self._fail(f"tensor-parallel worker rank {w.rank} failed while {ACTIVITY.get(method, method)}:"
                                 f"\n{payload}")
            if ready:  # the sentinel: the process is gone and left no answer
                raise self._fail(self._describe_failure(w, method))
            if time.monotonic() > deadline:
                raise self._fail(f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) gave no answer in "
                                 f"{DIST_TIMEOUT_S:.0f} s while {ACTIVITY.get(method, method)}; it looks stuck")

    def _watch(self, fn: Callable[[], Any], method: str) -> Any:
        """Run a blocking call (rendezvous) in a thread while watching that no worker dies meanwhile."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = fn()
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=target, name="pagedesk-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(POLL_S)
            for w in self.workers:
                if not w.process.is_alive():
                    raise self._fail(self._describe_failure(w, method))
        if "error" in box:
            raise box["error"]
        return box.get("result")

    # ---- failure ------------------------------------------------------------------------------------------

    def _explain_local_failure(self, exc: Exception, method: str) -> BaseException:
        """Rank 0's own call raised: a collective broken by a worker that died, or rank 0's own fault."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        pending = list(self.workers)
        while pending and time.monotonic() < deadline:
            for w in list(pending):
                if not w.process.is_alive():
                    return self._fail(self._describe_failure(w, method))
                if w.results.poll():
                    try:
                        status, payload = w.results.recv()
                    except (EOFError, OSError):  # the pipe closed before the process could be reaped
                        return self._fail(self._describe_failure(w, method))
                    if status == "error":
                        return self._fail(f"tensor-parallel worker rank {w.rank} failed while "
                                          f"{ACTIVITY.get(method, method)}:\n{payload}")
                    pending.remove(w)  # this worker finished the step: not the culprit
            wait([w.process.sentinel for w in pending] + [w.results for w in pending], timeout=POLL_S)
        self._fail(f"rank 0 failed while {ACTIVITY.get(method, method)}: {exc!r}")
        return exc

    def _describe_failure(self, w: WorkerProcess, method: str) -> str:
        return describe_failure(w, ACTIVITY.get(method, method))

    def _fail(self, message: str) -> RuntimeError:
        """Record the failure, stop every worker, and return the error for the caller to raise."""
        if self.failure is None:
            self.failure = message
            logger.error(message)
        self.shutdown()
        return RuntimeError(message)

    # ---- shutdown -----------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """End every worker (politely, then by signal) and leave the torch.distributed group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self.workers:
            try:
                w.commands.send(("shutdown", (), self.ring.seq))
            except (OSError, EOFError):
                pass
        self.ring.wake()
        self._finalizer.detach()
        self._resources.release(grace_s=STOP_GRACE_S if self.failure is None else 0.5,
                                abort=self.failure is not None)
