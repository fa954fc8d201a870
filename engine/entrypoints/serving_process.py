"""What every serving process shares: the one-engine server (serve.py), the router (router/main.py) and the
engines the router starts (router_engine.py).

The exit codes a supervisor reads (the app's, the router's), the listening socket bound before anything loads
(a taken port is a one-line error, not a wasted load), the signal handler that makes a requested stop exit 0,
and the environment variable that hands an engine its private API key. Standard library only: the router
imports this module and must never import torch or the engine behind it.
"""
from __future__ import annotations

import socket
import sys

EXIT_CONFIG_ERROR = 2
EXIT_OUT_OF_MEMORY = 3
EXIT_LOAD_FAILED = 1
EXIT_ENGINE_DIED = 4
# An engine's key travels in the environment, not on the command line every local user can read.
ENGINE_API_KEY_ENV = "PAGEDESK_ENGINE_API_KEY"


def stop_quietly(signum: int, frame: object) -> None:
    """Handler uvicorn restores and re-raises after its graceful shutdown: a requested stop exits 0."""


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads; OSError (e.g. address in use) says why not."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def bind_socket_or_say(host: str, port: int) -> socket.socket | None:
    """bind_socket, or None after telling the user why the port cannot be had (a configuration error)."""
    try:
        return bind_socket(host, port)
    except OSError as exc:
        print(f"error: cannot serve on {host}:{port}: {exc.strerror or exc} (is the port in use? "
              "choose another with --port)", file=sys.stderr, flush=True)
        return None
