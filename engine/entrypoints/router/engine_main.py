"""The router's engine process: `python -m engine.entrypoints.router.engine_main ROUTER_PID <pagedesk-serve flags>`.

Exactly `pagedesk-serve` for one model, after arming engine/distributed/parent_watch.py, so an engine never outlives its
router (not even a SIGKILLed one). Its tensor-parallel workers already die with it. The engine's private API
key comes in the environment (`PAGEDESK_ENGINE_API_KEY`), not on the command line that every local user can
read in the process list.
"""
from __future__ import annotations

import os
import sys

from engine.distributed.parent_watch import die_with_parent


KEY_ENV = "PAGEDESK_ENGINE_API_KEY"


def main(argv: list[str]) -> int:
    die_with_parent(int(argv[0]))
    from engine.entrypoints.serve import main as serve_main
    key = os.environ.pop(KEY_ENV, None)
    return serve_main(argv[1:] + (["--api-key", key] if key else []))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
