"""A real window under Xvfb with Qt's xcb platform (tests/xvfb_smoke.py), when Xvfb is installed.

`bash installer/setup.sh --dev` installs Xvfb and the X libraries Qt's xcb plugin needs; without
them this test is skipped with that instruction, since the offscreen tests cover the logic.
"""
import qt_helpers as helpers

import os
import shutil
import subprocess
import sys

import pytest

SMOKE = helpers.FAKE_SERVE.with_name("xvfb_smoke.py")


@pytest.mark.skipif(shutil.which("xvfb-run") is None,
                    reason="Xvfb not installed (bash installer/setup.sh --dev installs it)")
def test_real_window_under_xvfb(tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "xcb", "PAGEDESK_DATA_DIR": str(tmp_path / "data"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "PYTHONPATH": str(SMOKE.parent.parent)}
    env.pop("DISPLAY", None)
    done = subprocess.run(["xvfb-run", "-a", "-s", "-screen 0 1400x900x24", sys.executable, str(SMOKE)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for step in ("window mapped on the X screen", "engine READY", "chat reply streamed", "STOPPED after Stop",
                 "window closed"):
        assert f"ok {step}" in done.stdout
