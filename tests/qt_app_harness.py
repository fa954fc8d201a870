"""A stand-in for the `pagedesk` process in the engine-lifetime tests: a Qt event loop and an EngineSupervisor.

`python tests/qt_app_harness.py PID_FILE PORT MODEL [ENGINE FLAG ...] -- COMMAND ...` starts COMMAND as the
engine exactly as the app does (its own session, `--exit-with-parent` this pid), writes the engine's pid to
PID_FILE once /health answers, and then runs until killed — the test SIGKILLs it and watches the engine.
"""
from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QCoreApplication


def main(argv: list[str]) -> int:
    split = argv.index("--")
    (pid_file, port, model, *extra), command = argv[:split], argv[split + 1:]
    from app.supervisor import EngineSupervisor

    app = QCoreApplication([])
    supervisor = EngineSupervisor(command=command, max_restarts=0)
    supervisor.log.connect(lambda text: print(text, end="", flush=True))
    supervisor.ready.connect(lambda _url: Path(pid_file).write_text(str(supervisor.pid)))
    supervisor.crashed.connect(lambda code, _lines: app.exit(10))
    if not supervisor.start(model, {"host": "127.0.0.1", "port": int(port)}, extra):
        return 11
    return app.exec()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
