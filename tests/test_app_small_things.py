"""Issue 26's small things: the curl snippet bounds its reply, the status chip leaves the status bar room
(long text elided, whole in its tooltip), the dark theme's check boxes have a visible outline, and the
engine log records a Stop and its outcome."""
import qt_helpers as helpers

import os

import pytest
from PySide6.QtWidgets import QApplication

from app.endpoint_panel import curl_snippet
from app.status_chip import MAX_CHIP_WIDTH, StatusChip
from app.supervisor import STOPPED, EngineSupervisor
from app.theme import apply_theme


def test_the_curl_snippet_bounds_the_reply():
    assert '"max_tokens": 64' in curl_snippet("http://127.0.0.1:8000", None, "m")


def test_a_long_chip_is_elided_with_the_whole_text_in_its_tooltip(qtbot):
    chip = StatusChip()
    qtbot.addWidget(chip)
    model = "an-extremely-long-model-name-" * 6
    chip.set_status("READY", model, "http://127.0.0.1:8000/v1")
    assert chip.maximumWidth() == MAX_CHIP_WIDTH and "…" in chip.text()
    assert chip.toolTip() == f"● READY · {model} · http://127.0.0.1:8000/v1" == chip.full_text
    assert chip.fontMetrics().horizontalAdvance(chip.text()) <= MAX_CHIP_WIDTH


def test_dark_check_boxes_are_outlined(monkeypatch, qapp):
    monkeypatch.setenv("PAGEDESK_THEME", "dark")
    try:
        assert apply_theme(qapp)
        sheet = QApplication.instance().styleSheet()
        assert "QCheckBox::indicator" in sheet and "border: 1px solid #8a93a3" in sheet
        assert os.path.exists(sheet.split("url(")[1].split(")")[0])  # the tick image ships with the app
    finally:
        monkeypatch.setenv("PAGEDESK_THEME", "light")
        assert not apply_theme(qapp) and QApplication.instance().styleSheet() == ""


@pytest.mark.skipif(os.name != "posix", reason="process groups are POSIX")
def test_the_log_records_a_stop(qtbot):
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    lines = []
    sup.log.connect(lines.append)
    try:
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            sup.start("/m", {"port": helpers.free_port()})
        pid = sup.pid
        with qtbot.waitSignal(sup.state_changed, timeout=10_000, check_params_cb=lambda s: s == STOPPED):
            sup.stop()
        text = "".join(lines)
        assert f"[pagedesk] Stop: SIGTERM to the engine (pid {pid})" in text
        assert "[pagedesk] The engine stopped (exit code" in text
    finally:
        sup.shutdown()


@pytest.mark.skipif(os.name != "posix", reason="process groups are POSIX")
def test_a_restart_starts_the_logs_afresh_and_they_follow(qtbot, tmp_path):
    """Issue 38, item 8: after Restart the Loaded models tab showed the previous run's log; the engine log now
    follows new lines (unless scrolled up); loads and unloads asked in the tab are logged."""
    from PySide6.QtCore import QSettings

    from app.demo_data import demo_model_folder
    from app.main_window import MainWindow
    from app.supervisor import READY

    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    win = MainWindow(settings=QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat), supervisor=sup,
                     num_gpus=0, sample_gpus=False)
    qtbot.addWidget(win)
    try:
        demo_model_folder(tmp_path / "Chat")
        assert win.model_picker.set_model_path(str(tmp_path / "Chat"))
        win.settings_form.set_values({"port": helpers.free_port()})
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            win.start_engine()
        panel = win.loaded_models
        qtbot.waitUntil(lambda: panel.selected() == "Chat" and "fake-serve: ready" in panel.log_view.toPlainText(),
                        timeout=10_000)  # the main model is selected: its log shows without a click
        first_pid = sup.pid
        panel.feed_log("a line of the first run\n")
        with qtbot.waitSignal(sup.ready, timeout=15_000):
            win.restart_engine()
        assert sup.pid != first_pid and "a line of the first run" not in panel.log_view.toPlainText()
        assert sup.state == READY
        win.log_view.resize(400, 120)
        for i in range(200):
            win._append_log(f"line {i}\n")
        bar = win.log_view.verticalScrollBar()
        assert bar.value() == bar.maximum()  # it follows
        panel._on_acted("Chat", "unload", True, "")
        assert "[pagedesk] Chat: unloaded" in win.log_view.toPlainText()
    finally:
        win.shutdown()


def test_small_words_read_right(qtbot, tmp_path):
    """Issue 38, item 11: latencies in s past a second, plurals without "(s)", the dtype a transformers-5 config
    writes as `dtype`, an MoE model's active parameters, and an empty API key that says "none"."""
    import json

    from app.model_info import read_model_info
    from app.model_library import parameters_text, quantization_of
    from app.settings import gui_flags
    from app.settings_form import SettingsForm
    from app.units import format_ms, plural

    assert [format_ms(x) for x in (3.25, 142, 12_345, 200_000)] == ["3.2 ms", "142 ms", "12.3 s", "3.3 min"]
    assert (plural(1, "warning"), plural(2, "warning"), plural(2, "GPU")) == ("1 warning", "2 warnings", "2 GPUs")
    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "float32", "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 512}))
    info = read_model_info(folder)
    assert quantization_of(info.config, info.dtype) == "none (float32)"  # "none (unknown)" before
    info.num_parameters = 10_000_000
    assert info.active_parameters and parameters_text(info).startswith("10.00M (") and "active)" in parameters_text(info)
    form = SettingsForm(gui_flags())
    qtbot.addWidget(form)
    assert form.editors["api_key"].input.placeholderText() == "none: the endpoint is open"


def test_benchmark_failures_and_load_buttons_are_in_words_and_in_their_state(qtbot):
    from app.benchmark_worker import failure_words
    from app.loaded_models import LoadedModelsPanel, ModelRow

    raw = 'HTTP 400: {"error": {"message": "prompt + max_tokens = 1,539 > max_model_len 1,024", "type": "x"}}'
    assert failure_words(raw) == "the server refused it (HTTP 400): prompt + max_tokens = 1,539 > max_model_len 1,024"
    panel = LoadedModelsPanel()
    qtbot.addWidget(panel)
    panel._show([ModelRow("chat", "loaded", "CPU", 1, 64, "none"), ModelRow("code", "unloaded", "", 0, 64, "none")])
    assert panel.selected() == "chat" and panel.unload_button.isEnabled() and not panel.load_button.isEnabled()
    panel.table.selectRow(1)
    assert panel.load_button.isEnabled() and not panel.unload_button.isEnabled()
