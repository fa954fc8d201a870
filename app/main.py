"""Entry point of the `pagedesk` console script (and `python -m app`): QApplication + MainWindow, or, for
`pagedesk launch ...`, the agent launcher (app/launch.py), which runs without Qt.

Quitting always runs the window's shutdown, so the engine's process group is stopped even when the
application is ended from outside the window (Ctrl+C in the terminal or SIGTERM at logout, which
Qt alone would not turn into a clean quit). `--serve-at-login` (the XDG autostart entry's command)
starts serving the last model at once and stays in the tray, keeping the engine up when the window
is closed; without a tray it shows the window, since nothing else could bring it back. A second
`pagedesk` for the same data folder brings the first one's window to the front and exits
(app/single_instance.py). Where no window can open (no display, or not the X libraries Qt needs) it says
so and what to do instead (app/display_check.py), and exits 1 before Qt could abort. Python's cyclic garbage
collector runs only on the GUI thread (pyqtgraph's GarbageCollector: automatic collection off, a timer collects):
a collection started in a worker or relay thread would destroy Qt objects there, whose timers then fire on freed
memory (the segfault the test suite met under two workers).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedesk", description="PagedDesk desktop serving workstation")
    parser.add_argument("--serve-at-login", action="store_true",
                        help="start serving the last model in the tray, keep serving when the window closes")
    args, _qt_args = parser.parse_known_args(argv[1:])
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv)
    if len(argv) > 1 and argv[1] == "launch":  # a terminal command: no Qt is imported for it
        from app.launch import main as launch
        return launch(argv[2:])
    return run_gui(argv)


def run_gui(argv: list[str]) -> int:
    from PySide6.QtCore import QTimer
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication
    from pyqtgraph.util.garbage_collector import GarbageCollector

    from app.display_check import display_problem
    from app.main_window import MainWindow
    from app.paths import ICON_PATH
    from app.single_instance import SingleInstance
    from app.theme import follow_system_theme

    args = parse_args(argv)
    problem = None if QApplication.instance() else display_problem(os.environ)
    if problem:
        print(problem, file=sys.stderr, flush=True)
        return 1
    app = QApplication.instance() or QApplication(argv)
    app.setApplicationName("PagedDesk")
    app.setOrganizationName("PagedDesk")
    app.setDesktopFileName("pagedesk")
    app.setWindowIcon(QIcon(str(ICON_PATH)))
    follow_system_theme(app)
    guard = SingleInstance(parent=app)
    if guard.hand_over():
        print("PagedDesk is already running; its window was brought to the front.", flush=True)
        return 0
    guard.listen()
    window = MainWindow()
    window.open_first_view()
    guard.show_requested.connect(lambda: (print("pagedesk: another start asked for this window", flush=True),
                                          window.tray.open_window()))
    app.aboutToQuit.connect(window.shutdown)
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl+C, logout: quit properly so the engine group stops
        signal.signal(sig, lambda *_: app.quit())
    wake = QTimer(interval=250, timeout=lambda: None)  # lets Python run its signal handlers
    wake.start()
    collector = GarbageCollector(interval=1.0)  # noqa: F841 -- held for the loop's lifetime: its timer collects
    serving = False
    if args.serve_at_login:
        window.keep_serving_for_session = True
        serving = window.start_engine()
    if not (serving and window.tray.available()):  # a failed start must be seen: show the window
        window.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
