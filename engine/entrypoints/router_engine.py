"""The process the router starts for one engine: `python -m engine.entrypoints.router_engine <pagedesk-serve flags>`.

Exactly `pagedesk-serve` for one replica of one model; the router passes `--exit-with-parent ROUTER_PID` among
the flags, so an engine never outlives its router (not even a SIGKILLed one), and its tensor-parallel workers
already die with it. The only thing added here: the engine's private API key comes in the environment
(serving_process.ENGINE_API_KEY_ENV), not on the command line that every local user can read in the process
list, and it goes back in as one `--api-key=KEY` item, so a key that starts with `-` is never read as an option.
It lives beside serve.py, not in the router package, because it imports the engine and the router never
does: the router names this module only in the command it runs.
"""
from __future__ import annotations

import os
import sys

from engine.entrypoints.serve import main as serve_main
from engine.entrypoints.serving_process import ENGINE_API_KEY_ENV


def engine_argv(argv: list[str], key: str | None) -> list[str]:
    """pagedesk-serve's arguments with the key as one `--api-key=KEY` item (a key may start with `-`)."""
    return argv + ([f"--api-key={key}"] if key else [])


def main(argv: list[str]) -> int:
    key = os.environ.pop(ENGINE_API_KEY_ENV, None)  # popped: tensor-parallel workers need not inherit it
    return serve_main(engine_argv(argv, key))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
