"""The real-window smoke run that tests/test_app_xvfb.py starts under xvfb-run with Qt's xcb platform.

A new user's path through the real window against the fake server: the window maps on an X screen,
the Start action serves the chosen model (READY once it answered a request), the status chip and title show
the live URL, a chat reply streams in under the model's name, Stop passes through STOPPING to STOPPED, and
closing the window leaves no process.
Prints one "ok …" line per step; any failure exits non-zero with the reason.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import qt_helpers as helpers  # noqa: E402

from PySide6.QtCore import QEventLoop, QSettings  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402


def wait(app: QApplication, condition, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            sys.exit(f"timed out waiting for {what}")
        app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
    print(f"ok {what}", flush=True)


def main() -> None:
    app = QApplication(sys.argv[:1])
    assert app.platformName() == "xcb", f"platform {app.platformName()}, expected xcb"
    from app.demo_data import demo_model_folder
    from app.main_window import MainWindow
    from app.supervisor import READY, STOPPED, EngineSupervisor
    from app.theme import apply_theme

    apply_theme(app)
    tmp = Path(tempfile.mkdtemp(prefix="pagedesk-xvfb-"))
    demo_model_folder(tmp / "Qwen2.5-7B-Instruct")
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    win = MainWindow(settings=QSettings(str(tmp / "s.ini"), QSettings.Format.IniFormat), supervisor=sup,
                     num_gpus=0, sample_gpus=False)
    win.show()
    wait(app, lambda: win.isVisible() and win.windowHandle() is not None and win.windowHandle().isExposed(),
         10, "window mapped on the X screen")
    assert win.model_picker.set_model_path(str(tmp / "Qwen2.5-7B-Instruct"))
    port = helpers.free_port()
    win.settings_form.set_values({"port": port})
    win.start_action.trigger()
    wait(app, lambda: sup.state == READY, 15, "engine READY")
    assert f"127.0.0.1:{port}/v1" in win.state_label.text() and f":{port}/v1" in win.windowTitle()
    win.tabs.setCurrentWidget(win.chat)
    win.chat.input.setPlainText("hello")
    win.chat.send_button.click()
    wait(app, lambda: "fake engine" in win.chat.view.toPlainText() and not win.chat.generating, 10,
         "chat reply streamed")
    assert "Assistant · Qwen2.5-7B-Instruct" in win.chat.view.toPlainText(), "the reply names its model"
    image = win.grab().toImage()
    assert image.width() > 600 and image.height() > 400
    pid = sup.pid
    win.stop_action.trigger()
    wait(app, lambda: sup.state == STOPPED, 10, "STOPPED after Stop")
    assert not helpers.pid_alive(pid)
    win.close()
    wait(app, lambda: not win.isVisible(), 5, "window closed")
    print(f"ok tray available: {win.tray.available()}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PAGEDESK_DATA_DIR", tempfile.mkdtemp(prefix="pagedesk-xvfb-data-"))
    main()
