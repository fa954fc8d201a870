"""Shared set-up for the Qt tests: offscreen platform, a private data dir, helpers for processes.

Imported first by every tests/test_app_*.py and tests/test_widgets_*.py module, so Qt never looks
for a display and the app never touches the real user's data or settings.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("PAGEDESK_DATA_DIR", tempfile.mkdtemp(prefix="pagedesk-test-data-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAKE_SERVE = Path(__file__).with_name("qt_fake_serve.py")
FAKE_SERVE_COMMAND = [sys.executable, str(FAKE_SERVE)]


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a zombie holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
