"""`pagedesk-doctor [--json]`: print the readiness table (or JSON) and exit 1 when any check failed."""
from __future__ import annotations

import argparse
import sys

from engine.doctor.checks import collect_rows
from engine.doctor.report import exit_code, format_table, to_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedesk-doctor", description="Is this machine ready to serve on its "
                                     "GPUs? One pass/warn/fail row per check, with a remedy for each problem.")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (for scripts and the GUI)")
    args = parser.parse_args(argv)
    rows = collect_rows()
    print(to_json(rows) if args.json else format_table(rows))
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
