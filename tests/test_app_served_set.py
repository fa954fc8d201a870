"""Several models from the app (issue 24's app side): the served set's flags (parsed by the real router's
spec builder), its persistence, each model's own log split out of the router's output, the Monitor's model
selector re-pointing the engine-state stream, and a Start that serves the set through one endpoint."""
import qt_helpers as helpers

import os

import pytest
from PySide6.QtCore import QSettings

from app.loaded_models import LoadedModelsPanel, ModelRow
from app.model_logs import ROUTER, ModelLogs
from app.monitor_panel import MonitorPanel
from app.served_set import ServedSet, load_served_set, save_served_set
from app.stats_client import StatsWorker


def test_the_set_becomes_router_flags_the_router_accepts(tmp_path):
    from engine.entrypoints.router.specs import build_specs
    from engine.entrypoints.serve import build_parser, split_model_flags

    assert ServedSet().router_argv("/models/a", 2) == []  # alone: today's single engine
    served = ServedSet(["/models/coder/", "/other/coder", "/models/small"], model_ttl_minutes=30,
                       one_copy_per_card=True)
    argv = served.router_argv("chat", 2)
    assert argv == ["--model", "coder=/models/coder/", "--model", "coder-2=/other/coder", "--model",
                    "small=/models/small", "--model-ttl", "1800", "--data-parallel-size", "2",
                    "--tensor-parallel-size", "1"]
    models, rest = split_model_flags(["--model", "/models/chat", "--served-model-name", "chat",
                                      "--tensor-parallel-size", "2", *argv])
    config = build_specs(models, vars(build_parser().parse_args(rest)))
    assert list(config.models) == ["chat", "coder", "coder-2", "small"]  # the chosen model keeps its name
    assert config.models["chat"].data_parallel_size == 2 and config.models["small"].model_ttl == 1800
    assert ServedSet(one_copy_per_card=True).router_argv("m", 1) == []  # one card: nothing to copy onto


def test_the_set_persists(tmp_path):
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    assert load_served_set(settings) == ServedSet()
    save_served_set(settings, ServedSet(["/a"], 5, True))
    again = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    assert load_served_set(again) == ServedSet(["/a"], 5, True)


def test_each_model_gets_its_own_log():
    logs = ModelLogs()
    assert logs.feed("[chat#0] INFO loading\n[coder#1] INFO ready\nPagedDesk serving 2 models\n[chat#0] half") == \
        {"chat", "coder", ROUTER}
    assert logs.lines("chat") == ["#0 INFO loading"] and logs.lines("coder") == ["#1 INFO ready"]
    logs.feed(" a line\n")
    assert logs.lines("chat")[-1] == "#0 half a line" and logs.lines(ROUTER) == ["PagedDesk serving 2 models"]


def test_the_loaded_models_tab_shows_the_selected_models_log(qtbot):
    panel = LoadedModelsPanel()
    qtbot.addWidget(panel)
    panel._show([ModelRow("chat", "loaded", "CPU", 1, 64, "none"), ModelRow("coder", "unloaded", "", 0, 64, "none")])
    panel.feed_log("[chat#0] chat engine up\n[coder#0] coder engine up\n")
    panel.table.selectRow(1)
    assert panel.log_view.toPlainText() == "#0 coder engine up" and "coder" in panel.log_title.text()
    panel.feed_log("[coder#0] more\n")
    assert panel.log_view.toPlainText().endswith("more")
    single = LoadedModelsPanel()  # a one-engine server prints no prefixes: its whole output is its log
    qtbot.addWidget(single)
    single._show([ModelRow("m", "loaded", "CPU", 1, 64, "none", managed=False)])
    single.table.selectRow(0)
    single.feed_log("INFO: Application startup complete.\n")
    assert single.log_view.toPlainText() == "INFO: Application startup complete."


def test_the_monitor_selector_follows_the_loaded_models(qtbot):
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    rows = [ModelRow("chat", "loaded", "CPU", 1, 64, "none"), ModelRow("coder", "loaded", "CPU", 1, 64, "none")]
    monitor.set_models(rows[:1])
    assert not monitor.model_selector.isVisibleTo(monitor)  # one model: nothing to choose
    monitor.set_models(rows)
    assert monitor.model_selector.isVisibleTo(monitor) and monitor.model_selector.count() == 2
    with qtbot.waitSignal(monitor.model_selected) as picked:
        monitor.model_selector.setCurrentIndex(1)
    assert picked.args == ["coder"]
    assert StatsWorker("http://h:1", None, 4.0, "coder").params == {"hz": 4.0, "model": "coder"}
    assert StatsWorker("http://h:1", None, 4.0).params == {"hz": 4.0}


@pytest.mark.skipif(os.name != "posix", reason="process groups are POSIX")
def test_start_serves_the_set_and_loads_the_chosen_model(qtbot, tmp_path):
    from app.demo_data import demo_model_folder
    from app.main_window import MainWindow
    from app.supervisor import EngineSupervisor

    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    save_served_set(settings, ServedSet([str(tmp_path / "Coder")], model_ttl_minutes=10))
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    win = MainWindow(settings=settings, supervisor=sup, num_gpus=0, sample_gpus=False)
    qtbot.addWidget(win)
    try:
        demo_model_folder(tmp_path / "Chat")
        assert win.model_picker.set_model_path(str(tmp_path / "Chat"))
        assert win.served_panel.alongside.count() == 1
        win.settings_form.set_values({"port": helpers.free_port(), "served_model_name": "chat"})
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            assert win.start_engine()
        argv = sup.argv()
        assert argv[argv.index("--model") + 1] == str(tmp_path / "Chat")
        assert f"Coder={tmp_path / 'Coder'}" in argv and argv[argv.index("--model-ttl") + 1] == "600"
        assert win.stats.model == "chat"  # the Monitor shows the chosen model's engine
        qtbot.waitUntil(lambda: "chat" not in win.loaded_models.pending, timeout=10_000)  # its load was asked
        win.served_panel.alongside.setCurrentRow(0)
        win.served_panel.remove_button.click()
        assert load_served_set(settings).alongside == [] and "next Start" in win.statusBar().currentMessage()
    finally:
        win.shutdown()
