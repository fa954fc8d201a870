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
