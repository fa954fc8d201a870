"""The engine never outlives the app that started it: the app (a Qt harness subprocess, tests/qt_app_harness.py)
is SIGKILLed and its engine — the fake one, then the real `python -m engine.entrypoints.serve` on a tiny model — is gone
within a bounded wait. Also: `--exit-with-parent` is parsed strictly, and a server started by hand never arms it."""
import qt_helpers as helpers

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.distributed.parent_watch import split_parent_flag
from engine.entrypoints.serve import EXIT_CONFIG_ERROR, main as serve_main

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent watch is tested on Linux")
ROOT = Path(__file__).resolve().parent.parent
HARNESS = Path(__file__).with_name("qt_app_harness.py")


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the harness exited ({proc.returncode}) before {what}: {proc.stdout.read()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")


def kill_app_then_engine_is_gone(tmp_path, engine_command: list[str], model: str, extra: list[str],
                                 ready_timeout_s: float) -> None:
    pid_file = tmp_path / "engine.pid"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    app = subprocess.Popen([sys.executable, str(HARNESS), str(pid_file), str(helpers.free_port()), model, *extra,
                            "--", *engine_command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           cwd=ROOT, env=env)
    engine = None
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), ready_timeout_s, "engine READY", app)
        engine = int(pid_file.read_text())
        assert helpers.pid_alive(engine) and os.getsid(engine) == engine  # its own session, as the app starts it
        os.kill(app.pid, signal.SIGKILL)
        app.wait(10)
        started = time.monotonic()
        wait_for(lambda: not helpers.pid_alive(engine), 10, "engine exit after the app was SIGKILLed")
        print(f"engine gone {time.monotonic() - started:.2f} s after the app was killed")
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
        if engine is not None and helpers.pid_alive(engine):
            os.killpg(engine, signal.SIGKILL)
        app.stdout.close()


def test_sigkilled_app_takes_the_fake_engine_with_it(tmp_path):
    kill_app_then_engine_is_gone(tmp_path, helpers.FAKE_SERVE_COMMAND, "/nonexistent/model", [], 30)


def test_sigkilled_app_takes_the_real_engine_with_it(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    kill_app_then_engine_is_gone(tmp_path, [sys.executable, "-m", "engine.entrypoints.serve"], str(model),
                                 ["--device", "cpu", "--num-gpu-blocks-override", "64"], 180)


def test_exit_with_parent_flag_parsing():
    assert split_parent_flag(["--model", "m", "--exit-with-parent", "123", "--port", "1"]) == \
        (123, ["--model", "m", "--port", "1"])
    assert split_parent_flag(["--exit-with-parent=77"]) == (77, [])
    assert split_parent_flag(["--model", "m"]) == (None, ["--model", "m"])  # by hand: never armed
    for bad in (["--exit-with-parent"], ["--exit-with-parent", "x"], ["--exit-with-parent=1"]):
        with pytest.raises(ValueError, match="--exit-with-parent needs the parent's process id"):
            split_parent_flag(bad)


def test_serve_refuses_a_pid_that_is_not_its_parent(capsys):
    assert serve_main(["--exit-with-parent", "nope", "--model", "m"]) == EXIT_CONFIG_ERROR
    assert "--exit-with-parent needs" in capsys.readouterr().err
    not_parent = os.getppid() + 1 if os.getppid() + 1 != os.getpid() else os.getppid() + 2
    assert serve_main(["--exit-with-parent", str(not_parent), "--model", "m"]) == EXIT_CONFIG_ERROR
    assert "is not this one's parent" in capsys.readouterr().err
