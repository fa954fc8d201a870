"""The server process under stress: SIGTERM mid-stream, a stopped tensor-parallel worker, leftovers of a
SIGKILL. Real `python -m engine.entrypoints.serve` subprocesses; each stream is long by construction (4,000 tokens)
and each wait is bounded; nothing asserts wall time."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.entrypoints.serve import EXIT_ENGINE_DIED
from test_cli import free_port
from test_tensor_parallel import descendants

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def long_llama(tiny_model_dir):
    """The tiny llama with a 4,096-token context, so a stream can be made long by construction."""
    return tiny_model_dir("llama", max_position_embeddings=4096)


def start_serve(model_dir, port: int, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "engine.entrypoints.serve", "--model", str(model_dir), "--device", "cpu", "--port", str(port),
            "--num-gpu-blocks-override", "300", "--served-model-name", "tiny", *flags]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)


def wait_serving(proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"the server exited before serving: {lines}"
        lines.append(line)
        if line.startswith("PagedDesk serving"):
            return
    raise AssertionError(f"the server did not start: {lines}")


def open_long_stream(port: int, client: httpx.Client):
    """A chat stream that cannot finish soon: 4,000 tokens with EOS ignored."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell a long story"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    return client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body)


def read_events(lines, first_only: bool = False) -> list[str]:
    """SSE data up to [DONE]; with first_only, up to the first generated token (so a step has run)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(line[6:])
            if events[-1] == "[DONE]":
                return events
            if first_only and json.loads(events[-1])["choices"][0]["delta"].get("content"):
                return events
    return events


def kill(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out or ""


@pytest.mark.timeout(120)
def test_sigterm_ends_streams_in_band_then_exits_0(long_llama):
    port = free_port()
    proc = start_serve(long_llama, port)
    try:
        wait_serving(proc)
        with httpx.Client(timeout=60) as client, open_long_stream(port, client) as response:
            lines = response.iter_lines()
            assert read_events(lines, first_only=True)  # the stream runs
            proc.send_signal(signal.SIGTERM)
            events = read_events(lines)  # ends in-band, not with a cut connection
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert "shutting down" in error["message"] and error["type"] == "service_unavailable_error"
        assert proc.wait(30) == 0
        output = proc.stdout.read()
        assert "CancelledError" not in output and "Traceback" not in output, output
    finally:
        kill(proc)


def worker_pid(server_pid: int) -> int:
    """The tensor-parallel worker (its command line runs multiprocessing's spawn main, not the tracker)."""
    for pid in descendants(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError("no tensor-parallel worker process")


@pytest.mark.timeout(180)
def test_stopped_tensor_parallel_worker_trips_the_step_watchdog(long_llama):
    """SIGSTOP on the worker mid-stream: the step never returns; the watchdog ends the stream in-band, /health
    turns 503 and the process exits with code 4 so the GUI's supervisor restarts it."""
    port = free_port()
    proc = start_serve(long_llama, port, "--tensor-parallel-size", "2",
                       "--step-timeout", "2")
    stopped = None
    try:
        wait_serving(proc)
        stopped = worker_pid(proc.pid)
        with httpx.Client(timeout=60) as client, open_long_stream(port, client) as response:
            lines = response.iter_lines()
            assert read_events(lines, first_only=True)
            os.kill(stopped, signal.SIGSTOP)
            events = read_events(lines)
            saw_503 = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503
        assert events[-1] == "[DONE]", events[-3:]
        assert "--step-timeout" in json.loads(events[-2])["error"]["message"]
        assert saw_503
        assert proc.wait(60) == EXIT_ENGINE_DIED
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        kill(proc)


# ---- item 12: no rendezvous folder outlives a SIGKILLed server ---------------------------------------------------

def test_stale_rendezvous_folders_of_dead_processes_are_removed(tmp_path):
    from engine.executor.worker_processes import STORE_PREFIX, remove_stale_store_dirs
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"{STORE_PREFIX}{dead.pid}-abc").mkdir()
    (tmp_path / f"{STORE_PREFIX}{dead.pid}-abc" / "rendezvous").write_text("x")
    (tmp_path / f"{STORE_PREFIX}{os.getpid()}-def").mkdir()  # a live owner: kept
    (tmp_path / "pagedesk-tp-notapid").mkdir()  # not ours to judge: kept
    assert remove_stale_store_dirs(str(tmp_path)) == [f"{STORE_PREFIX}{dead.pid}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{STORE_PREFIX}{os.getpid()}-def",
                                                                  "pagedesk-tp-notapid"])


def _stalled_stream(port: int) -> socket.socket:
    """A long chat stream whose client never reads: a tiny receive buffer, so the server's send blocks soon."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
                       "ignore_eos": True, "stream": True}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


@pytest.mark.timeout(150)
def test_sigterm_with_every_kind_of_request_in_flight_is_quiet(long_llama):
    """SIGTERM while a reading stream, a stream nobody reads, a non-streaming request, the engine-state stream
    and a half-sent request are all open: the reading streams end in-band, the process exits 0, and the log
    holds no traceback (in particular no 'CancelledError: Task cancelled, timeout graceful shutdown exceeded')."""
    port = free_port()
    proc = start_serve(long_llama, port)
    socks = []
    try:
        wait_serving(proc)
        socks.append(_stalled_stream(port))
        half = socket.create_connection(("127.0.0.1", port), timeout=30)
        half.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        socks.append(half)
        whole: dict = {}

        def non_streaming():
            body = {"model": "tiny", "prompt": "x", "max_tokens": 4000, "ignore_eos": True}
            try:
                whole["status"] = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                             timeout=60).status_code
            except httpx.HTTPError as exc:
                whole["status"] = type(exc).__name__
        waiter = threading.Thread(target=non_streaming)
        waiter.start()
        with httpx.Client(timeout=60) as client, open_long_stream(port, client) as response, \
                client.stream("GET", f"http://127.0.0.1:{port}/v1/engine/state/stream?hz=4") as state:
            lines = response.iter_lines()
            assert read_events(lines, first_only=True)
            state_lines = state.iter_lines()
            assert next(line for line in state_lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            events = read_events(lines)
            state_tail = [line for line in state_lines if line.startswith("data: ")]
        waiter.join(60)
        assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
        assert "error" in json.loads(state_tail[-1][6:])  # the state stream ends saying why
        assert whole["status"] == 503, whole
        assert proc.wait(30) == 0
        output = proc.stdout.read()
        for noise in ("Traceback", "CancelledError", "graceful shutdown exceeded", "ASGI callable"):
            assert noise not in output, output
    finally:
        for s in socks:
            s.close()
        kill(proc)
