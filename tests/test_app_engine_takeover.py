"""An engine an earlier PagedDesk left running is recognised from the data folder's record (pid, URL, model,
verified against /proc and /health) and offered in a banner: "Take over" makes this window READY on it and
Stop ends it; "Stop it" ends it at once. Stale records (a dead pid, a pid that is no server) are dropped, and
the supervisor records its own engine while it runs."""
import qt_helpers as helpers

import os
import subprocess
import sys
import time

import pytest
from PySide6.QtCore import QSettings

from app.engine_record import EngineRecord, answers_health, find_leftover, read_record, record_path, write_record
from app.main_window import MainWindow
from app.supervisor import READY, STOPPED, EngineSupervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and process groups")


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")


@pytest.fixture
def data(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDESK_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture
def leftover(data):
    """A fake engine in its own session, as an earlier app would have left it, with its record written."""
    port = helpers.free_port()
    proc = subprocess.Popen([*helpers.FAKE_SERVE_COMMAND, "--port", str(port)], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record = EngineRecord(pid=proc.pid, pgid=proc.pid, base_url=f"http://127.0.0.1:{port}", port=port,
                          model="/models/Earlier-Model", app_pid=proc.pid + 1, started_at=time.time())
    wait_for(lambda: answers_health(record.base_url), 20, "fake engine answering /health")
    write_record(record)
    yield proc, record
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    proc.wait(10)


def make_window(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, backoff_s=0.05, grace_s=1.0)
    win = MainWindow(settings=settings, supervisor=sup, num_gpus=0, sample_gpus=False)
    qtbot.addWidget(win)
    return win


def test_take_over_then_stop(leftover, qtbot, tmp_path):
    proc, record = leftover
    win = make_window(qtbot, tmp_path)
    try:
        assert win.leftover_banner.isVisibleTo(win) and f"pid {record.pid}" in win.leftover_banner.text.text()
        assert "Earlier-Model" in win.leftover_banner.text.text()
        with qtbot.waitSignal(win.supervisor.ready, timeout=10_000):
            win.leftover_banner.take_button.click()
        assert win.supervisor.state == READY and win.supervisor.pid == proc.pid
        assert f":{record.port}/v1" in win.windowTitle() and win.stop_action.isEnabled()
        assert read_record().app_pid == os.getpid()  # the record now names this app
        with qtbot.waitSignal(win.supervisor.state_changed, timeout=10_000, check_params_cb=lambda s: s == STOPPED):
            win.stop_engine()
        assert proc.wait(5) is not None and not record_path().exists()
    finally:
        win.shutdown()


def test_stop_it_ends_the_leftover_and_start_is_refused_while_it_runs(leftover, qtbot, tmp_path):
    proc, record = leftover
    win = make_window(qtbot, tmp_path)
    try:
        from app.demo_data import demo_model_folder
        demo_model_folder(tmp_path / "Qwen2.5-7B-Instruct")
        assert win.model_picker.set_model_path(str(tmp_path / "Qwen2.5-7B-Instruct"))
        win.leftover_banner.hide()
        assert not win.start_engine() and win.leftover_banner.isVisibleTo(win)  # offered again, not a port clash
        assert not win.port_banner.isVisibleTo(win)
        with qtbot.waitSignal(win.supervisor.state_changed, timeout=10_000, check_params_cb=lambda s: s == STOPPED):
            win.leftover_banner.stop_button.click()
        assert proc.wait(5) is not None and not record_path().exists()
        assert not win.leftover_banner.isVisibleTo(win)
    finally:
        win.shutdown()


def test_stale_records_are_dropped(data):
    data.mkdir(parents=True, exist_ok=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for pid in (sleeper.pid, 2 ** 22 + 17):  # alive but not a server; no such process
            write_record(EngineRecord(pid=pid, pgid=pid, base_url="http://127.0.0.1:9", port=9, model="m",
                                      app_pid=1, started_at=0.0))
            assert find_leftover() is None and not record_path().exists()
    finally:
        sleeper.kill()
        sleeper.wait(10)
    record_path().write_text("{not json")
    assert find_leftover() is None and not record_path().exists()


def test_the_supervisor_records_its_engine_while_it_runs(data, qtbot):
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    port = helpers.free_port()
    try:
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            assert sup.start("/models/m", {"port": port})
        record = read_record()
        assert record.pid == sup.pid and record.port == port and record.model == "/models/m"
        assert record.app_pid == os.getpid() and find_leftover() is None  # ours: never offered to ourselves
        with qtbot.waitSignal(sup.state_changed, timeout=10_000, check_params_cb=lambda s: s == STOPPED):
            sup.stop()
        assert not record_path().exists()
    finally:
        sup.shutdown()
