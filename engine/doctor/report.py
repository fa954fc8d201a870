"""The doctor's rows and how they print: an aligned table for people, JSON for machines and the GUI."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

STATUSES = ("pass", "warn", "fail")


@dataclass(frozen=True, slots=True)
class Row:
    check: str  # e.g. "GPU 1", "P2P cuda:0->cuda:1"
    status: str  # pass | warn | fail
    detail: str  # what was found, with numbers
    remedy: str = ""  # one line: what to do about a warn or fail

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status


def exit_code(rows: list[Row]) -> int:
    """1 when any row failed; warnings alone pass (a CPU-only machine is a warning, not an error)."""
    return int(any(r.status == "fail" for r in rows))


def to_json(rows: list[Row]) -> str:
    return json.dumps({"rows": [asdict(r) for r in rows], "exit_code": exit_code(rows)}, indent=2)


def rows_from_json(text: str) -> list[Row]:
    return [Row(**r) for r in json.loads(text)["rows"]]


def format_table(rows: list[Row]) -> str:
    """Check | status | detail, with the remedy on its own indented line under a warn or fail."""
    width = max((len(r.check) for r in rows), default=5)
    lines = [f"{'CHECK':<{width}}  STATUS  DETAIL"]
    for r in rows:
        lines.append(f"{r.check:<{width}}  {r.status.upper():<6}  {r.detail}")
        if r.remedy and r.status != "pass":
            lines.append(f"{'':<{width}}          → {r.remedy}")
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    lines.append(f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed")
    return "\n".join(lines)
