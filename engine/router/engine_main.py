"""The router's engine process: `python -m engine.router.engine_main ROUTER_PID <pagedesk-serve flags>`.

Exactly `pagedesk-serve` for one model, after arming engine/parent_watch.py, so an engine never outlives its
router (not even a SIGKILLed one). Its tensor-parallel workers already die with it.
"""
from __future__ import annotations

import sys

from engine.parent_watch import die_with_parent


def main(argv: list[str]) -> int:
    die_with_parent(int(argv[0]))
    from engine.serve import main as serve_main
    return serve_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
