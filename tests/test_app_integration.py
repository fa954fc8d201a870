"""The whole window against the real `python -m engine.entrypoints.serve` with a tiny random-weight model:
start → READY, a streamed chat reply, the block map and plots updating from the state stream,
an outside SIGKILL → CRASHED within 2 s → automatic restart → READY, and quit leaving no process
of the engine's group behind. Also the window's NVML-absent state (this machine has no GPU)."""
import qt_helpers as helpers

import os
import signal
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings

from app.main_window import MainWindow
from app.supervisor import CRASHED, READY

pytestmark = pytest.mark.skipif(os.name != "posix", reason="process groups are POSIX")


def group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.fixture
def window(qtbot, tmp_path, llama_dir):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    win = MainWindow(settings=settings, extra_engine_args=["--device", "cpu", "--num-gpu-blocks-override", "512"])
    win.supervisor.backoff_s = 0.2
    qtbot.addWidget(win)
    assert win.model_picker.set_model_path(str(llama_dir))
    win.settings_form.set_values({"port": helpers.free_port(), "max_model_len": 256, "max_num_seqs": 8,
                                  "api_key": "sk-integration"})
    yield win
    win.close()


def test_start_chat_monitor_crash_restart_quit(window, qtbot):
    win = window
    assert "LlamaForCausalLM" in win.model_picker.details.text()
    assert "tokens fit" in win.capacity.text()
    with qtbot.waitSignal(win.supervisor.ready, timeout=120_000):
        win.start_action.trigger()
    assert READY in win.state_label.text()
    assert "serving" in win.log_view.toPlainText()
    qtbot.waitUntil(lambda: win.monitor.samples > 0, timeout=10_000)
    assert win.monitor.gpu_panel.engine_memory.text().startswith("Engine memory on cpu")

    states = []
    win.stats.state.connect(states.append)
    redraws = win.monitor.tokens_plot.redraw_count
    win.chat.max_tokens.setValue(60)
    win.chat.input.setPlainText("Tell me about paged attention.")
    with qtbot.waitSignal(win.chat.reply_finished, timeout=60_000) as done:
        win.chat.send_button.click()
    result = done.args[0]
    assert result.completion_tokens > 0 and result.text
    qtbot.waitUntil(lambda: "TTFT" in win.chat.view.toPlainText(), timeout=2000)
    qtbot.waitUntil(lambda: any(s.generation_tokens_total > 0 for s in states), timeout=5000)
    qtbot.waitUntil(lambda: win.monitor.tokens_plot.redraw_count > redraws, timeout=5000)
    assert any(s.num_running > 0 or s.kv_cache_usage > 0 or s.generation_tokens_per_s > 0 for s in states)
    image = win.monitor.block_map.image_array()
    assert image is not None and image.shape[0] * image.shape[1] >= 512
    assert "512 blocks" in win.monitor.block_map.summary.text()

    pid = win.supervisor.pid
    with qtbot.waitSignal(win.supervisor.crashed, timeout=2000):
        os.kill(pid, signal.SIGKILL)
    assert CRASHED in win.state_label.text()
    assert not win.crash_box.isHidden() and "killed by a signal" in win.crash_box.text()
    with qtbot.waitSignal(win.supervisor.ready, timeout=120_000):
        pass  # automatic restart with backoff
    new_pid = win.supervisor.pid
    assert new_pid != pid and READY in win.state_label.text()
    count = win.monitor.samples
    qtbot.waitUntil(lambda: win.monitor.samples > count, timeout=10_000)  # stats reconnected

    win.close()
    assert not helpers.pid_alive(new_pid)
    assert group_members(new_pid) == []


def test_window_shows_no_gpu_state(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    win = MainWindow(settings=settings)
    qtbot.addWidget(win)
    qtbot.waitUntil(lambda: win.monitor.gpu_panel.gpu_available is False, timeout=5000)
    assert "No NVIDIA GPU detected" in win.monitor.gpu_panel.status.text()
    assert win.settings_form.values()["tensor_parallel_size"] == 1
    win.chat.input.setPlainText("anyone there?")
    win.chat.send_button.click()
    assert "engine is not running" in win.chat.view.toPlainText()
    win.close()
