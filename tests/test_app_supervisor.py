"""EngineSupervisor against a fake server process: READY via /health, crash detection and restart,
no restart after an out-of-memory at load, the port-in-use fallback, and a stop/quit that leaves no
member of the engine's process group alive (even one that ignores SIGTERM)."""
import qt_helpers as helpers

import os
import signal
import socket

import pytest

from app.supervisor import CRASHED, READY, STOPPED, EngineSupervisor

pytestmark = pytest.mark.skipif(os.name != "posix", reason="process groups are POSIX")


@pytest.fixture
def supervisor(qtbot):
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, backoff_s=0.05, grace_s=1.0)
    yield sup
    sup.shutdown()


def start(sup, qtbot, port=None, **values):
    values = {"host": "127.0.0.1", "port": port or helpers.free_port(), **values}
    with qtbot.waitSignal(sup.ready, timeout=10_000):
        assert sup.start("/nonexistent/model", values)
    assert sup.state == READY


def test_ready_then_stop_kills_group(supervisor, qtbot, tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_SERVE_CHILD_PID_FILE", str(pid_file))
    start(supervisor, qtbot)
    leader = supervisor.pid
    assert os.getpgid(leader) == leader  # its own process group
    child = int(pid_file.read_text())
    assert os.getpgid(child) == leader
    assert any("fake-serve: ready" in line for line in supervisor.tail)
    with qtbot.waitSignal(supervisor.state_changed, timeout=5000, check_params_cb=lambda s: s == STOPPED):
        supervisor.stop()
    qtbot.waitUntil(lambda: not helpers.pid_alive(child), timeout=3000)
    assert not helpers.pid_alive(leader)


def test_kill_from_outside_is_crash_then_auto_restart(supervisor, qtbot):
    start(supervisor, qtbot)
    with qtbot.waitSignal(supervisor.crashed, timeout=2000) as crashed:
        os.kill(supervisor.pid, signal.SIGKILL)
    assert crashed.args[0] == -1 and supervisor.state == CRASHED
    with qtbot.waitSignal(supervisor.ready, timeout=10_000):
        pass  # automatic restart after backoff
    assert supervisor.restarts == 1


def test_restart_cap(qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_MODE", "exit1")
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, max_restarts=2, backoff_s=0.01)
    messages = []
    sup.message.connect(messages.append)
    sup.start("/m", {"host": "127.0.0.1", "port": helpers.free_port()})
    qtbot.waitUntil(lambda: any("gave up after 2" in m for m in messages), timeout=10_000)
    assert sup.state == CRASHED and sup.last_exit_code == 1


def test_stop_cancels_a_pending_restart(qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_MODE", "exit1")
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, backoff_s=30)
    with qtbot.waitSignal(sup.crashed, timeout=5000):
        sup.start("/m", {"host": "127.0.0.1", "port": helpers.free_port()})
    assert sup.restart_pending
    sup.stop()
    assert sup.state == STOPPED and not sup.restart_pending


def test_out_of_memory_at_load_is_not_restarted(qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_MODE", "oom")
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, backoff_s=0.01)
    messages = []
    sup.message.connect(messages.append)
    with qtbot.waitSignal(sup.crashed, timeout=5000) as crashed:
        sup.start("/m", {"host": "127.0.0.1", "port": helpers.free_port()})
    assert crashed.args[0] == 3 and "out of memory" in crashed.args[1]
    assert any("Not restarting" in m for m in messages)
    qtbot.wait(200)
    assert sup.process is None and sup.state == CRASHED and sup.restarts == 0


def test_sigterm_ignored_gets_sigkill_after_grace(qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_MODE", "ignore_term")
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=0.3)
    start(sup, qtbot)
    pid = sup.pid
    with qtbot.waitSignal(sup.state_changed, timeout=5000, check_params_cb=lambda s: s == STOPPED):
        sup.stop()
    assert not helpers.pid_alive(pid)


def test_shutdown_blocks_until_group_gone(qtbot, tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_SERVE_CHILD_PID_FILE", str(pid_file))
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    start(sup, qtbot)
    leader, child = sup.pid, int(pid_file.read_text())
    sup.shutdown()
    assert not helpers.pid_alive(leader)
    qtbot.waitUntil(lambda: not helpers.pid_alive(child), timeout=2000)


def test_port_in_use_moves_to_next_free_port(supervisor, qtbot):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        messages = []
        supervisor.message.connect(messages.append)
        start(supervisor, qtbot, port=busy)
    assert supervisor.port != busy and f":{supervisor.port}" in supervisor.base_url
    assert any(f"Port {busy}" in m and "in use" in m for m in messages)


def test_argv_is_built_from_flags(supervisor):
    supervisor._launch = ("/models/x", {"port": 8000, "max_num_seqs": 8, "enable_prefix_caching": False,
                                        "api_key": None}, ["--device", "cpu"])
    argv = supervisor.argv()
    assert argv[:2] == helpers.FAKE_SERVE_COMMAND
    assert argv[2:] == ["--model", "/models/x", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                        "--device", "cpu"]
