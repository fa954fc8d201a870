"""Is a TCP port free on a host, and if not, which process listens on it?

`port_is_free` binds the way the engine's server binds (with SO_REUSEADDR, as uvicorn does), so a
port held only by TIME-WAIT sockets of a previous run counts as free and a Restart keeps its port.
`port_owner` names the listening process from /proc (Linux; None elsewhere or when the process
belongs to another user), so the GUI can say who holds the port instead of silently moving.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

TCP_LISTEN = "0A"


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        if os.name == "posix":  # what uvicorn does; on Windows the option means "steal", so leave it off
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def next_free_port(host: str, start: int, tries: int = 50) -> int | None:
    """The first free port in [start, start + tries), or None."""
    for port in range(start, min(start + tries, 65536)):
        if port_is_free(host, port):
            return port
    return None


def _listening_inodes(port: int, proc: Path) -> set[str]:
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _holds_any(pid_dir: Path, links: set[str]) -> bool:
    try:
        fds = list((pid_dir / "fd").iterdir())
    except OSError:  # gone, or another user's process
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in links:
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def port_owner(port: int, proc: Path = Path("/proc")) -> str | None:
    """'name (pid N)' of a process listening on `port`, or None when it cannot be found."""
    inodes = _listening_inodes(port, proc)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid_dir in proc.glob("[0-9]*"):
        if _holds_any(pid_dir, wanted):
            try:
                name = (pid_dir / "comm").read_text().strip()
            except OSError:
                name = "?"
            return f"{name} (pid {pid_dir.name})"
    return None
