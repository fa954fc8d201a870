"""EngineSupervisor against a fake server process: READY via /health, crash detection and restart,
no restart after an out-of-memory or configuration error at load, a port left in TIME-WAIT reused
and a really taken one reported (never silently moved), STOPPING on the way down, a crash report of
the dying run only, the API key masked in the logged command, and a stop/quit that leaves no member
of the engine's process group alive (even one that ignores SIGTERM)."""
import qt_helpers as helpers

import os
import signal
import socket

import pytest

from app.port_check import port_owner
from app.supervisor import CRASHED, READY, STOPPED, STOPPING, EngineSupervisor, masked_argv, serve_command

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


def time_wait_port() -> int:
    """A port whose only trace is a TIME-WAIT socket: the server side closed a connection first."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's listener does
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the active closer keeps the (port, peer) pair in TIME-WAIT
        client.close()
    return port


def test_port_in_time_wait_is_reused(supervisor, qtbot):
    port = time_wait_port()
    busy = []
    supervisor.port_busy.connect(lambda *args: busy.append(args))
    start(supervisor, qtbot, port=port)
    assert supervisor.port == port and supervisor.base_url.endswith(f":{port}") and not busy


def test_port_really_taken_is_reported_not_moved(supervisor, qtbot):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy_port = taken.getsockname()[1]
        assert port_owner(busy_port).endswith(f"(pid {os.getpid()})")
        with qtbot.waitSignal(supervisor.port_busy) as busy:
            assert not supervisor.start("/m", {"host": "127.0.0.1", "port": busy_port})
    host, port, owner, suggestion = busy.args
    assert (host, port) == ("127.0.0.1", busy_port) and f"pid {os.getpid()}" in owner and suggestion > busy_port
    assert supervisor.process is None and supervisor.state == STOPPED


def test_stop_passes_through_stopping_and_a_crash_shows_only_its_own_run(supervisor, qtbot, monkeypatch):
    start(supervisor, qtbot)
    states = []
    supervisor.state_changed.connect(states.append)
    with qtbot.waitSignal(supervisor.state_changed, timeout=5000, check_params_cb=lambda s: s == STOPPED):
        supervisor.stop()
    assert states == [STOPPING, STOPPED]
    monkeypatch.setenv("FAKE_SERVE_MODE", "exit1")
    supervisor.max_restarts = 0
    with qtbot.waitSignal(supervisor.crashed, timeout=5000) as crashed:
        supervisor.start("/m", {"host": "127.0.0.1", "port": helpers.free_port()})
    assert "failing on purpose" in crashed.args[1]
    assert "fake-serve: ready" not in crashed.args[1]  # that line belongs to the earlier, healthy run


def test_configuration_error_is_not_restarted(qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_MODE", "config")
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, backoff_s=0.01)
    messages = []
    sup.message.connect(messages.append)
    with qtbot.waitSignal(sup.crashed, timeout=5000) as crashed:
        sup.start("/m", {"host": "127.0.0.1", "port": helpers.free_port()})
    assert crashed.args[0] == 2
    assert any("no *.safetensors weights" in m and "Not restarting" in m for m in messages)
    assert not sup.restart_pending and sup.restarts == 0 and sup.state == CRASHED


def test_api_key_is_masked_in_the_logged_command(supervisor, qtbot):
    logged = []
    supervisor.log.connect(logged.append)
    start(supervisor, qtbot, api_key="sk-secret-123")
    command = next(line for line in logged if line.startswith("$ "))
    assert "--api-key ****" in command and "sk-secret-123" not in "".join(logged)
    assert masked_argv(["x", "--api-key=sk-1", "--port", "1"]) == ["x", "--api-key=****", "--port", "1"]


def test_default_command_is_the_console_script(monkeypatch, tmp_path):
    (tmp_path / "pagedesk-serve").write_text("#!/bin/sh\n")
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    assert serve_command() == [str(tmp_path / "pagedesk-serve")]
    (tmp_path / "pagedesk-serve").unlink()
    assert serve_command()[1:] == ["-m", "engine.entrypoints.serve"]


def test_argv_is_built_from_flags(supervisor):
    supervisor._launch = ("/models/x", {"port": 8000, "max_num_seqs": 8, "enable_prefix_caching": False,
                                        "api_key": None}, ["--device", "cpu"])
    argv = supervisor.argv()
    assert argv[:2] == helpers.FAKE_SERVE_COMMAND
    assert argv[2:] == ["--model", "/models/x", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                        "--device", "cpu", "--exit-with-parent", str(os.getpid())]
