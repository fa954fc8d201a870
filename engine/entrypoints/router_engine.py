"""The process the router starts for one engine: `python -m engine.entrypoints.router_engine <pagedesk-serve flags>`.

Exactly `pagedesk-serve` for one replica of one model; the router passes `--exit-with-parent ROUTER_PID` among
the flags, so an engine never outlives its router (not even a SIGKILLed one), and its tensor-parallel workers
already die with it. The only thing added here: the engine's private API key comes in the environment
(serving_process.ENGINE_API_KEY_ENV), not on the command line that every local user can read in the process
list. It lives beside serve.py, not in the router package, because it imports the engine and the router never
does: the router names this module only in the command it runs.
"""
from __future__ import annotations

import os
import sys

from engine.entrypoints.serve import main as serve_main
from engine.entrypoints.serving_process import ENGINE_API_KEY_ENV


def main(argv: list[str]) -> int:
    key = os.environ.pop(ENGINE_API_KEY_ENV, None)  # popped: tensor-parallel workers need not inherit it
    return serve_main(argv + (["--api-key", key] if key else []))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
