"""The screenshot script renders every main view to a non-trivial PNG, and `main()` opens and quits
cleanly in a process of its own (exit code 0, no refcount abort at exit)."""
import qt_helpers as helpers

import os
import subprocess
import sys

from PySide6.QtGui import QImage

from app.screenshots import save_screenshots


def test_screenshots(qtbot, tmp_path):
    paths = save_screenshots(tmp_path)
    assert [p.name for p in paths] == ["engine.png", "models.png", "chat.png", "monitor.png", "endpoint.png",
                                    "monitor-kv-groups.png", "monitor-hybrid-moe.png"]
    for p in paths:
        image = QImage(str(p))
        assert image.width() >= 1000 and image.height() >= 700


MAIN_THEN_QUIT = """
import sys
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
app = QApplication(sys.argv)
QTimer.singleShot(1500, app.quit)
from app.main import main
code = main([])
assert not app.windowIcon().isNull(), "resources/pagedesk.svg did not load"
sys.exit(code)
"""


def test_main_opens_window_and_quits(tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "PAGEDESK_DATA_DIR": str(tmp_path / "data"),
           "QT_QPA_PLATFORM": "offscreen", "PYTHONPATH": str(helpers.FAKE_SERVE.parent.parent)}
    done = subprocess.run([sys.executable, "-c", MAIN_THEN_QUIT], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Fatal Python error" not in done.stderr
