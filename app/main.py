"""Entry point of the `pagedesk` console script (and `python -m app`): QApplication + MainWindow.

Quitting always runs the window's shutdown, so the engine's process group is stopped even when the
application is ended from outside the window (Ctrl+C in the terminal or SIGTERM at logout, which
Qt alone would not turn into a clean quit).
"""
from __future__ import annotations

import signal
import sys

from PySide6.QtCore import QTimer
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

from app.main_window import MainWindow
from app.paths import ICON_PATH


def main(argv: list[str] | None = None) -> int:
    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv)
    app.setApplicationName("PagedDesk")
    app.setOrganizationName("PagedDesk")
    app.setDesktopFileName("pagedesk")
    app.setWindowIcon(QIcon(str(ICON_PATH)))
    window = MainWindow()
    app.aboutToQuit.connect(window.shutdown)
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl+C, logout: quit properly so the engine group stops
        signal.signal(sig, lambda *_: app.quit())
    wake = QTimer(interval=250, timeout=lambda: None)  # lets Python run its signal handlers
    wake.start()
    window.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
