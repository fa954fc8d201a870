"""A second `pagedesk` hands over to the first: real `python -m app` subprocesses (offscreen, a private data
folder); the second exits 0 at once saying so, and the first is asked to show its window. Plus the guard's
own units: nobody listening means no hand-over, and a socket left by a dead instance does not block."""
import qt_helpers as helpers

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.single_instance import SingleInstance, instance_name

pytestmark = pytest.mark.skipif(os.name != "posix", reason="tested on POSIX")
ROOT = Path(__file__).resolve().parent.parent


def test_guard_units(qtbot, tmp_path):
    name = f"pagedesk-test-{os.getpid()}-{tmp_path.name}"
    assert not SingleInstance(name).hand_over(timeout_ms=200)  # nobody runs
    first = SingleInstance(name)
    assert first.listen()
    asked = []
    first.show_requested.connect(lambda: asked.append(True))
    # the hand-over blocks while the first answers from the event loop, so it runs in a subprocess
    code = (f"import sys; from PySide6.QtCore import QCoreApplication; app = QCoreApplication([]); "
            f"from app.single_instance import SingleInstance; sys.exit(0 if SingleInstance({name!r}).hand_over() else 1)")
    second = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    qtbot.waitUntil(lambda: second.poll() is not None, timeout=20_000)
    assert second.returncode == 0 and asked == [True]
    first.server.close()
    assert SingleInstance(name).listen()  # a leftover name from an instance that is gone does not block


def test_a_second_pagedesk_brings_the_first_to_the_front(qtbot, tmp_path, monkeypatch):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QT_QPA_PLATFORM": "offscreen",
           "PAGEDESK_DATA_DIR": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    monkeypatch.setenv("PAGEDESK_DATA_DIR", str(tmp_path / "data"))
    name = instance_name()
    first = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        from PySide6.QtNetwork import QLocalSocket

        deadline = time.monotonic() + 90
        while True:  # until the first listens (a bare connection, without "show", asks nothing of it)
            probe = QLocalSocket()
            probe.connectToServer(name)
            if probe.waitForConnected(200):
                probe.disconnectFromServer()
                break
            assert first.poll() is None, first.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the first instance never listened"
            time.sleep(0.2)
        second = subprocess.run([sys.executable, "-m", "app"], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=90)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "already running; its window was brought to the front" in second.stdout
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            out, _ = first.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            first.kill()
            out, _ = first.communicate()
    assert "another start asked for this window" in out
