"""EngineProcess: one engine (`pagedesk-serve` for one replica of one model) as a child of the router.

It listens on a free loopback port with a random API key of its own (other local users cannot reach it
around the router's key), on the cards its placement names (CUDA_VISIBLE_DEVICES; on CPU data parallel, its
own cores through the affinity mask), with an absolute KV budget (--kv-cache-memory) so siblings on the
card do not shrink it. Start-up is ready when the engine prints its "PagedDesk serving" line; an exit
before that is a load failure carrying the engine's last log lines. Exit codes follow
engine/entrypoints/serving_process.py: a configuration error (2) or out of memory at load (3) is not retried;
anything else may be, after a backoff that doubles. Each engine runs in its own session, so stopping it
(SIGTERM to its group, then SIGKILL after a grace period) takes its tensor-parallel workers along.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path

from engine.config.flags import flags_to_argv
from engine.entrypoints.router.balancer import ReplicaLoad
from engine.entrypoints.router.placement import HOST, ReplicaPlacement
from engine.entrypoints.router.proxy import Relays
from engine.entrypoints.router.specs import ModelSpec
from engine.entrypoints.serving_process import ENGINE_API_KEY_ENV, EXIT_CONFIG_ERROR, EXIT_OUT_OF_MEMORY

log = logging.getLogger("pagedesk.router")
ROOT = Path(__file__).resolve().parents[3]
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STOP_GRACE_S = 10.0
ENGINE_MODULE = "engine.entrypoints.router_engine"  # pagedesk-serve with its key from the environment


class LoadFailed(Exception):
    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    def __init__(self, spec: ModelSpec, index: int, placement: ReplicaPlacement):
        self.spec, self.index, self.placement = spec, index, placement
        self.api_key = secrets.token_urlsafe(24)
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.state = "stopped"  # stopped | loading | ready | dead | failed
        self.error: str | None = None
        self.log: deque[str] = deque(maxlen=200)
        self.load = ReplicaLoad()
        self.inflight = 0
        self.relays = Relays()  # requests and watchers relayed to it now
        self.last_answer = 0.0  # time.monotonic() of its last answer to a liveness probe (or of its start)
        self.failures = 0
        self.restart_after = 0.0
        self._ready = asyncio.Event()
        self._reader: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def argv(self) -> list[str]:
        flags = dict(self.spec.engine_flags)
        on_gpu = self.placement.cards != (HOST,)
        if on_gpu and flags.get("num_gpu_blocks_override") is None:
            flags["kv_cache_memory"] = round(self.placement.kv_cache_gib, 4)
        # Each value joined to its flag (`--flag=value`): a path or a name may start with '-'.
        return [sys.executable, "-m", ENGINE_MODULE, f"--exit-with-parent={os.getpid()}", f"--model={self.spec.path}",
                f"--served-model-name={self.spec.name}", "--host=127.0.0.1", f"--port={self.port}",
                *flags_to_argv(flags)]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        env[ENGINE_API_KEY_ENV] = self.api_key
        if self.placement.cards != (HOST,):
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # NVML's numbering, which placement used
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.placement.cards)
        if self.placement.cpu_cores:
            env["OMP_NUM_THREADS"] = str(len(self.placement.cpu_cores))
        return env

    def _pin(self) -> None:  # runs in the child before exec
        if self.placement.cpu_cores:
            os.sched_setaffinity(0, self.placement.cpu_cores)

    async def start(self, timeout_s: float) -> None:
        """Start and wait until it serves; LoadFailed says why not. Waits out the backoff of earlier deaths."""
        delay = self.restart_after - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        last: LoadFailed | None = None
        for _ in range(3):  # a port taken between choosing and binding it: choose another
            self.port = free_port()
            try:
                await self._start_once(timeout_s)
                self.failures, self.error = 0, None
                return
            except LoadFailed as exc:
                last = exc
                if "cannot serve on" not in str(exc):
                    break
        assert last is not None
        self._failed(last)
        raise last

    def _failed(self, exc: LoadFailed) -> None:
        self.error = str(exc)
        self.state = "dead" if exc.retry else "failed"
        self.failures += 1
        self.restart_after = time.monotonic() + BACKOFF_S[min(self.failures, len(BACKOFF_S)) - 1]

    async def _start_once(self, timeout_s: float) -> None:
        self.state, self._ready = "loading", asyncio.Event()
        self.log.clear()
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=self.env(), cwd=str(ROOT), start_new_session=True,
            preexec_fn=self._pin if self.placement.cpu_cores else None)
        log.info("%s#%d: starting engine pid %d on %s", self.spec.name, self.index, self.proc.pid, self.where())
        self._reader = asyncio.create_task(self._read_log(self.proc))
        ready = asyncio.create_task(self._ready.wait())
        exited = asyncio.create_task(self.proc.wait())
        done, _ = await asyncio.wait({ready, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        exited.cancel()
        if ready in done and self.alive():
            self.state, self.last_answer = "ready", time.monotonic()
            return
        if not done:
            await self.stop()
            raise LoadFailed(f"{self.spec.name}: the engine did not load within {timeout_s:.0f} s", retry=True)
        await self.proc.wait()
        if self._reader is not None:
            await asyncio.wait({self._reader}, timeout=2)
        code = self.proc.returncode
        last = next((line for line in reversed(self.log) if line.startswith("error:")), None) or \
            (self.log[-1] if self.log else "no output")
        raise LoadFailed(f"{self.spec.name}: the engine exited with code {code} while loading: {last}",
                         retry=code not in (EXIT_CONFIG_ERROR, EXIT_OUT_OF_MEMORY))

    async def _read_log(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while True:
            raw = await proc.stdout.readline()
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip()
            self.log.append(line)
            log.info("[%s#%d] %s", self.spec.name, self.index, line)
            if line.startswith("PagedDesk serving"):
                self._ready.set()

    def where(self) -> str:
        if self.placement.cards == (HOST,):
            cores = f" cores {','.join(map(str, self.placement.cpu_cores))}" if self.placement.cpu_cores else ""
            return "CPU" + cores
        return "cuda:" + ",".join(str(i) for i in self.placement.cards)

    def note_exit(self) -> None:
        """Called when the process is found dead while it should serve: restart later, with backoff."""
        if self.state == "ready":
            code = self.proc.returncode if self.proc else None
            self.error = f"{self.spec.name}: engine #{self.index} exited with code {code} while serving"
            log.warning(self.error)
            self._failed(LoadFailed(self.error, retry=code != EXIT_OUT_OF_MEMORY))

    def note_hung(self, message: str) -> None:
        """Called once its group was killed for not answering: restart later, with backoff."""
        self.error = message
        self._failed(LoadFailed(message, retry=True))

    def rss_bytes(self) -> int | None:
        """The engine process's resident memory (Linux /proc), None when it cannot be read."""
        if self.proc is None:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            _signal_group(self.proc.pid, sig)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the engine's process group (its streams end in-band), SIGKILL after the grace period."""
        proc = self.proc
        if proc is None:
            self.state = "stopped"
            return
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except asyncio.TimeoutError:
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # a worker left in the group after its engine exited
        if self._reader is not None:
            await asyncio.wait({self._reader}, timeout=2)
        self.state = "stopped"
        self.load.outstanding_tokens = 0


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
