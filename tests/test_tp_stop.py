"""Stopping a tensor-parallel engine (issue 19 item 4): a SIGTERM to the whole process group (what the GUI
sends) ends every stream in-band even while a step is held up, and lets rank 0 drain and end its worker with a
"shutdown" command; a stopped worker (SIGSTOP) is found by
its heartbeat, apart from step progress, so /health turns 503 within seconds even with the CPU's 600 s step
timeout. Real `python -m engine.entrypoints.serve` subprocesses over 2 gloo ranks; every wait is bounded."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from engine.entrypoints.serve import EXIT_ENGINE_DIED
from test_cli import free_port
from test_server_process import ROOT, kill, open_long_stream, read_events, wait_serving, worker_pid


@pytest.fixture(scope="module")
def long_llama(tiny_model_dir):
    return tiny_model_dir("llama", max_position_embeddings=4096)


def start_tp_serve(model_dir, port: int) -> subprocess.Popen:
    """Two ranks on CPU in a process group of their own, like the GUI's supervisor starts them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "engine.entrypoints.serve", "--model", str(model_dir), "--device", "cpu", "--port", str(port),
            "--num-gpu-blocks-override", "300", "--served-model-name", "tiny", "--tensor-parallel-size", "2"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)


@pytest.mark.timeout(180)
def test_sigterm_mid_step_ends_the_stream_in_band_and_drains_rank_0_first(long_llama):
    """The step in flight is held up on purpose (the worker SIGSTOPped, so rank 0 waits in a collective, as it
    would behind a slow card) when SIGTERM reaches the group: the stream must still end with the in-band error
    at once, not be cut when uvicorn's graceful shutdown runs out; the step then finishes and all ranks leave."""
    port = free_port()
    proc = start_tp_serve(long_llama, port)
    stopped = None
    try:
        wait_serving(proc)
        with httpx.Client(timeout=60) as client, open_long_stream(port, client) as response:
            lines = response.iter_lines()
            assert read_events(lines, first_only=True)  # steps are running (4,000 tokens: the stream cannot end)
            stopped = worker_pid(proc.pid)
            os.kill(stopped, signal.SIGSTOP)  # the step in flight (or the next) now waits on this worker
            os.killpg(proc.pid, signal.SIGTERM)  # the worker gets it too, and ignores it
            events = read_events(lines)  # ends in-band while the step is still held, not with a cut connection
            os.kill(stopped, signal.SIGCONT)  # well inside the 5 s heartbeat limit: only the stream's end was read
            stopped = None
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert "shutting down" in error["message"] and error["type"] == "service_unavailable_error", events[-3:]
        assert proc.wait(60) == 0
        output = proc.stdout.read()
        # The worker left on rank 0's "shutdown" command (exit 0), after rank 0's last step: not killed by the
        # signal (-15) nor by the grace-period kill (-9), and no step failed on a missing peer.
        assert "tensor-parallel worker rank 1" in output and "ended with exit code 0" in output, output[-3000:]
        assert "engine step failed" not in output and "died" not in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    finally:
        release(proc, stopped)


def release(proc, stopped: int | None) -> None:
    """Resume a SIGSTOPped worker and kill whatever of the server's group is left."""
    if stopped is not None:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    kill(proc)


@pytest.mark.timeout(180)
def test_stopped_worker_turns_health_503_within_seconds(long_llama):
    port = free_port()
    proc = start_tp_serve(long_llama, port)
    stopped = None
    try:
        wait_serving(proc)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        stopped = worker_pid(proc.pid)
        os.kill(stopped, signal.SIGSTOP)  # idle: no step is running, so no step timeout could notice
        start, status = time.monotonic(), 200
        while time.monotonic() - start < 10 and status == 200:
            time.sleep(0.25)
            status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code
        print(f"/health answered {status} {time.monotonic() - start:.1f} s after SIGSTOP")
        assert status == 503
        assert proc.wait(60) == EXIT_ENGINE_DIED
        assert "has sent no heartbeat" in proc.stdout.read()
    finally:
        release(proc, stopped)
