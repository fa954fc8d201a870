"""A record of the engine this app started (pid, process group, URL, model), kept in the data folder.

The supervisor writes `engine.json` when its engine process starts and removes it when that process
ends. A record still present at the next launch means the last app ended without taking its engine
along (the parent watch was off, or the app died where it could not act). `find_leftover` trusts a
record only when it still describes a live engine: the pid exists, its command line is a PagedDesk
server (`engine.entrypoints.serve` / `pagedesk-serve`), and its /health answers; anything else is stale and the
file is removed. The window then offers "Take over" or "Stop it" instead of a port clash.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from app.paths import data_dir

RECORD_NAME = "engine.json"
SERVER_MARKERS = ("engine.entrypoints.serve", "pagedesk-serve", "qt_fake_serve")  # the last: the test suite's stand-in
HEALTH_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class EngineRecord:
    pid: int
    pgid: int
    base_url: str
    port: int
    model: str
    app_pid: int
    started_at: float


def record_path() -> Path:
    return data_dir() / RECORD_NAME


def write_record(record: EngineRecord, path: Path | None = None) -> None:
    path = path or record_path()
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(asdict(record)))
    temporary.replace(path)  # a reader never sees half a record


def clear_record(pid: int | None = None, path: Path | None = None) -> None:
    """Remove the record (only if it names `pid`, when given: a newer engine's record stays)."""
    path = path or record_path()
    record = read_record(path)
    if record is not None and pid is not None and record.pid != pid:
        return
    path.unlink(missing_ok=True)


def read_record(path: Path | None = None) -> EngineRecord | None:
    try:
        data = json.loads((path or record_path()).read_text())
        return EngineRecord(**{k: data[k] for k in EngineRecord.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pid_alive(pid: int) -> bool:
    """`pid` still runs (a zombie counts as gone: /proc says so on Linux; another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def is_server_process(pid: int) -> bool:
    """The process `pid` is alive, ours to signal, and runs a PagedDesk server (read from /proc; elsewhere
    being alive and ours is all that can be told)."""
    if not pid_alive(pid):
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        return False  # another user's process: never ours
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.parent.exists():
        return True
    try:
        argv = cmdline.read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return False
    return any(marker in argv for marker in SERVER_MARKERS)


def answers_health(base_url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """An HTTP server answers /health at `base_url` (a 503 while it loads counts: it is there)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def find_leftover(path: Path | None = None) -> EngineRecord | None:
    """The recorded engine if it is still a live, healthy PagedDesk server not owned by this app; else None
    (a stale record is removed)."""
    path = path or record_path()
    record = read_record(path)
    if record is None:
        path.unlink(missing_ok=True)
        return None
    if record.app_pid == os.getpid():
        return None  # ours, running now
    if not is_server_process(record.pid) or not answers_health(record.base_url):
        path.unlink(missing_ok=True)
        return None
    return record


def new_record(pid: int, base_url: str, port: int, model: str) -> EngineRecord:
    pgid = os.getpgid(pid) if hasattr(os, "getpgid") else pid
    return EngineRecord(pid=pid, pgid=pgid, base_url=base_url, port=port, model=model, app_pid=os.getpid(),
                        started_at=time.time())
