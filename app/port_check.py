"""Is a TCP port free on a host? Checked with a real bind, before the engine tries to serve on it.

A bind (not a connect) is the honest test: it fails exactly when the server's own bind would.
"""
from __future__ import annotations

import socket


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
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
