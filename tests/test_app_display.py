"""The README's first command on a machine without a display (issue 38, item 4): `pagedesk` says so before Qt
starts and names the two ways on — pagedesk-serve for headless serving, or what to install for the window —
instead of Qt's SIGABRT with its reinstall hint."""
import qt_helpers as helpers

import os
import subprocess
import sys

from app.display_check import XCB_LIBRARIES, display_problem



def test_no_display_is_named_with_what_to_do():
    problem = display_problem({}, "linux", lambda name: f"lib{name}.so")
    assert "no display" in problem and "pagedesk-serve --model" in problem and "xvfb-run" in problem
    assert display_problem({"DISPLAY": ":0"}, "linux", lambda name: f"lib{name}.so") is None
    assert display_problem({"WAYLAND_DISPLAY": "wayland-0"}, "linux", lambda name: None) is None  # no X needed
    assert display_problem({"QT_QPA_PLATFORM": "offscreen"}, "linux", lambda name: None) is None  # told where
    assert display_problem({}, "darwin", lambda name: None) is None


def test_missing_x_libraries_are_named_by_package():
    missing = {"xcb-cursor", "xkbcommon-x11"}
    problem = display_problem({"DISPLAY": ":1"}, "linux", lambda name: None if name in missing else name)
    assert "sudo apt-get install libxcb-cursor0 libxkbcommon-x11-0" in problem and "pagedesk-serve" in problem
    assert set(XCB_LIBRARIES.values()) >= {"libxcb-cursor0", "libxkbcommon-x11-0"}


def test_pagedesk_without_a_display_exits_with_the_message_not_an_abort(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env.update(PAGEDESK_DATA_DIR=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               PYTHONPATH=str(helpers.FAKE_SERVE.parent.parent))
    done = subprocess.run([sys.executable, "-m", "app"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "no display" in done.stderr and "pagedesk-serve" in done.stderr and "Aborted" not in done.stderr
