"""The main window against the fake server: a taken port shown in a banner with "Use port N" (never
moved silently), the status chip and title carrying state, model and the live URL, Start disabled
without a model, Stop through STOPPING with the app's streams closed first, a crash panel that
clears once READY again, a settings pane that is never clipped, and keep-serving on close."""
import qt_helpers as helpers

import os
import socket

import pytest
from PySide6.QtCore import QSettings

from app.demo_data import demo_model_folder
from app.main_window import MainWindow
from app.supervisor import READY, STOPPED, STOPPING, EngineSupervisor

pytestmark = pytest.mark.skipif(os.name != "posix", reason="process groups are POSIX")


@pytest.fixture
def window(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, backoff_s=0.05, grace_s=1.0)
    win = MainWindow(settings=settings, supervisor=sup, num_gpus=0, sample_gpus=False)
    qtbot.addWidget(win)
    yield win
    win.shutdown()


def choose_model(win, tmp_path):
    demo_model_folder(tmp_path / "Qwen2.5-7B-Instruct")
    assert win.model_picker.set_model_path(str(tmp_path / "Qwen2.5-7B-Instruct"))


def test_start_needs_a_model_and_the_chip_shows_state_model_and_url(window, qtbot, tmp_path):
    win = window
    assert not win.start_action.isEnabled() and win.windowTitle() == "PagedDesk"
    choose_model(win, tmp_path)
    assert win.start_action.isEnabled()
    port = helpers.free_port()
    win.settings_form.set_values({"port": port})
    with qtbot.waitSignal(win.supervisor.ready, timeout=10_000):
        win.start_action.trigger()
    url = f"http://127.0.0.1:{port}/v1"
    assert win.state_label.text() == f"● READY · Qwen2.5-7B-Instruct · {url}"
    assert win.windowTitle() == f"PagedDesk — Qwen2.5-7B-Instruct — {url}"
    assert not win.start_action.isEnabled()
    with qtbot.waitSignal(win.supervisor.state_changed, timeout=5000, check_params_cb=lambda s: s == STOPPED):
        win.stop_engine()
    win.settings_form.set_values({"max_model_len": 40000})  # the model has 32,768
    assert not win.start_engine() and "longer than the model's 32,768" in win.statusBar().currentMessage()
    assert win.model_picker.set_model_path(str(tmp_path / "no-such-model")) is False
    assert not win.start_action.isEnabled()
    assert "Choose a model" in win.capacity.text()  # no stale plan for the previous model


def test_taken_port_shows_a_banner_and_use_port_starts_there(window, qtbot, tmp_path):
    win = window
    choose_model(win, tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        win.settings_form.set_values({"port": busy})
        assert not win.start_engine()
        assert win.port_banner.isVisibleTo(win) and f"Port {busy}" in win.port_banner.text.text()
        assert f"pid {os.getpid()}" in win.port_banner.text.text()
        assert f"Port {busy}" in win.statusBar().currentMessage()
        suggestion = win.port_banner.suggestion
        assert suggestion > busy and win.port_banner.use_button.text() == f"Use port {suggestion}"
        with qtbot.waitSignal(win.supervisor.ready, timeout=10_000):
            win.port_banner.use_button.click()
    assert win.settings_form.values()["port"] == suggestion  # the form says where it really serves
    assert f":{suggestion}/v1" in win.state_label.text() and not win.port_banner.isVisibleTo(win)


def test_stop_closes_streams_first_and_passes_through_stopping(window, qtbot, tmp_path, monkeypatch):
    win = window
    terminate = win.supervisor.stop
    streams_open_at_sigterm = []
    monkeypatch.setattr(win.supervisor, "stop", lambda: (streams_open_at_sigterm.append(not win.stats.is_idle()),
                                                         terminate()))
    choose_model(win, tmp_path)
    win.settings_form.set_values({"port": helpers.free_port()})
    with qtbot.waitSignal(win.supervisor.ready, timeout=10_000):
        win.start_engine()
    qtbot.waitUntil(lambda: win.monitor.samples > 0, timeout=5000)
    chips = []
    win.supervisor.state_changed.connect(lambda _s: chips.append(win.state_label.text()))
    with qtbot.waitSignal(win.supervisor.state_changed, timeout=5000, check_params_cb=lambda s: s == STOPPED):
        win.stop_action.trigger()
        assert win.supervisor.state == STOPPING and not win.stop_action.isEnabled()
    # uvicorn cancels streams still open at SIGTERM with a traceback each: the app closes its own first
    assert streams_open_at_sigterm == [False] and win.chat.base_url is None
    assert chips[0].startswith(f"● {STOPPING}")
    assert chips[-1] == "● STOPPED · Qwen2.5-7B-Instruct"  # no URL once nothing serves


def test_crash_panel_clears_once_ready_again(window, qtbot, tmp_path):
    win = window
    choose_model(win, tmp_path)
    win.settings_form.set_values({"port": helpers.free_port()})
    with qtbot.waitSignal(win.supervisor.ready, timeout=10_000):
        win.start_engine()
    with qtbot.waitSignal(win.supervisor.crashed, timeout=5000):
        os.kill(win.supervisor.pid, 9)
    assert not win.crash_box.isHidden()
    with qtbot.waitSignal(win.supervisor.ready, timeout=10_000):
        pass  # automatic restart
    assert win.crash_box.isHidden() and win.supervisor.state == READY


def test_settings_pane_is_not_clipped_at_the_default_size(window, qtbot):
    win = window
    win.show()
    qtbot.waitExposed(win)
    win.settings_form.show_advanced.setChecked(True)
    qtbot.waitUntil(lambda: win.settings_form.advanced.isVisible())
    scroll = win.settings_scroll
    assert scroll.horizontalScrollBar().maximum() == 0
    assert scroll.viewport().width() >= scroll.widget().minimumSizeHint().width()


def test_close_keeps_serving_only_when_asked_and_a_tray_exists(window, qtbot, tmp_path, monkeypatch):
    win = window
    choose_model(win, tmp_path)
    win.settings_form.set_values({"port": helpers.free_port()})
    with qtbot.waitSignal(win.supervisor.ready, timeout=10_000):
        win.start_engine()
    win.show()
    win.keep_serving_action.setChecked(True)
    monkeypatch.setattr(win.tray, "available", lambda: True)
    win.close()
    assert win.isHidden() and win.supervisor.state == READY and win.supervisor.pid is not None
    assert "READY" in win.tray.status_action.text() and win.tray.copy_action.isEnabled()
    win.tray.open_action.trigger()
    assert win.isVisible()
    pid = win.supervisor.pid
    win.keep_serving_action.setChecked(False)
    win.close()
    assert not helpers.pid_alive(pid)


def test_tray_menu_and_quit_stop_the_engine_group(window, qtbot, tmp_path, monkeypatch):
    win = window
    labels = [a.text() for a in win.tray.menu.actions() if a.text()]
    assert labels[0] == "STOPPED" and labels[1:] == ["Copy endpoint URL", "▶ Start engine", "■ Stop",
                                                     "Open PagedDesk", "Quit (stops the engine)"]
    choose_model(win, tmp_path)
    win.settings_form.set_values({"port": helpers.free_port()})
    with qtbot.waitSignal(win.supervisor.ready, timeout=10_000):
        win.tray.menu.actions()[3].trigger()  # Start, from the tray
    pid = win.supervisor.pid
    quits = []
    stub_app = type("App", (), {"quit": lambda self: quits.append(True)})()
    monkeypatch.setattr("app.main_window.QApplication", type("QApplication", (), {"instance": lambda: stub_app}))
    win.quit_action.trigger()
    assert quits == [True] and not helpers.pid_alive(pid)


def test_planner_counts_what_other_programs_hold_while_the_engine_is_stopped(window, tmp_path):
    from widgets.gpu_panel import GpuReading
    win = window
    choose_model(win, tmp_path)
    gib = 1 << 30
    reading = lambda used: [GpuReading(0, "RTX 4090", used, 24 * gib, 0, 40, 50.0, 450.0)]  # noqa: E731
    win._on_gpu_readings(reading(0))
    idle = win.capacity.text()
    win._on_gpu_readings(reading(100 << 20))  # under the re-plan step: the line stays
    assert win.capacity.text() == idle
    win._on_gpu_readings(reading(3 * gib))  # a game took 3 GiB
    busy = win.capacity.text()
    tokens = lambda line: int(line.split(" tokens fit")[0].rsplit("· ", 1)[1].replace(",", ""))  # noqa: E731
    assert "tokens fit" in idle and "tokens fit" in busy and tokens(busy) < tokens(idle)


def test_a_failure_is_forgotten_when_the_model_or_settings_change_and_on_every_attempt(window, qtbot, tmp_path,
                                                                                         monkeypatch):
    win = window
    choose_model(win, tmp_path)
    win.settings_form.set_values({"port": helpers.free_port()})
    monkeypatch.setenv("FAKE_SERVE_MODE", "config")  # exits 2 at load: never restarted

    def fail_once(why="no *.safetensors weights"):
        with qtbot.waitSignal(win.supervisor.crashed, timeout=10_000):
            assert win.start_engine()
        assert win.supervisor.state == "CRASHED" and not win.crash_box.isHidden()
        assert why in win.crash_box.text()

    fail_once()
    demo_model_folder(tmp_path / "Other-Model")
    assert win.model_picker.set_model_path(str(tmp_path / "Other-Model"))
    assert win.state_label.text() == "● STOPPED · Other-Model"  # never "CRASHED · <the new model>"
    assert win.crash_box.isHidden() and win.crash_box.text() == ""
    assert win.start_action.isEnabled()

    fail_once()
    win.settings_form.set_values({"max_num_seqs": 4})  # an edited setting
    assert win.supervisor.state == STOPPED and win.crash_box.isHidden() and not win.supervisor.tail

    monkeypatch.setenv("FAKE_SERVE_MODE", "exit1")  # restarted, after a long backoff
    win.supervisor.backoff_s = 60
    fail_once("failing on purpose")
    assert win.supervisor.restart_pending
    with socket.socket() as taken:  # the next attempt is refused: it shows that refusal, not the old crash
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        win.settings_form.set_values({"port": taken.getsockname()[1]})
        assert not win.start_engine()
    assert not win.supervisor.restart_pending  # it would have relaunched the old settings
    assert win.state_label.text().startswith("● STOPPED") and win.crash_box.isHidden()
    assert not win.port_banner.isHidden()
    assert "automatic restart was cancelled" in win.log_view.toPlainText()


def test_a_settings_error_disables_start_until_it_is_fixed(window, qtbot, tmp_path):
    win = window
    choose_model(win, tmp_path)
    assert win.start_action.isEnabled() and win.restart_action.isEnabled()
    win.settings_form.set_values({"max_model_len": 10_000_000})  # the model has 32,768
    assert not win.start_action.isEnabled() and not win.restart_action.isEnabled()
    assert "marked in red" in win.start_action.toolTip()
    assert not win.settings_form.editors["max_model_len"].error.isHidden()
    assert not win.start_engine()  # the tray or a shortcut still cannot start it
    assert "longer than the model's 32,768" in win.statusBar().currentMessage()
    win.settings_form.set_values({"max_model_len": 4096})
    assert win.start_action.isEnabled() and win.settings_form.editors["max_model_len"].error.isHidden()
