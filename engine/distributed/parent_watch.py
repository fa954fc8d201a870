"""Make a spawned worker process die with its parent, so no exit path of the engine leaves an orphan.

Three layers, because each covers a gap in the others: the kernel's parent-death signal (Linux
prctl PR_SET_PDEATHSIG, which fires even when the parent is SIGKILLed), a daemon thread that polls
os.getppid() (re-parenting shows the parent is gone on systems without prctl), and the caller's control
pipe, whose EOF ends the worker's receive loop. Never raises: a worker without prctl still has the poll.
`pagedesk-serve --exit-with-parent PID` arms the same watch in a server: the desktop app passes its own
pid, so killing the app (even with SIGKILL) ends its engine; a server started by hand never arms it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
EXIT_WITH_PARENT_FLAG = "--exit-with-parent"


def split_parent_flag(argv: list[str]) -> tuple[int | None, list[str]]:
    """The pid after `--exit-with-parent` (None when absent) and the other arguments; ValueError names a bad value."""
    pid, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == EXIT_WITH_PARENT_FLAG or arg.startswith(EXIT_WITH_PARENT_FLAG + "="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit() or int(value) <= 1:
                raise ValueError(f"{EXIT_WITH_PARENT_FLAG} needs the parent's process id (a number above 1), "
                                 f"got {value!r}")
            pid = int(value)
            continue
        rest.append(arg)
        i += 1
    return pid, rest


def die_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Call first thing in the worker. PR_SET_PDEATHSIG fires when the *thread* that spawned the worker
    exits, so an engine must be built on a thread that lives as long as it does (the main thread offline,
    the engine thread in the server); the poll below is tied to the process."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=_poll_parent, args=(parent_pid, poll_s), name="parent-watch", daemon=True).start()


def _poll_parent(parent_pid: int, poll_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(1)
