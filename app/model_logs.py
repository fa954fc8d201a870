"""Each served model's own log, split out of the router's output.

The router prints every engine's lines as "[NAME#i] line" (engine/entrypoints/router/backend.py), so the app's one
log stream carries them all; `ModelLogs.feed` sorts them into a bounded list per model (the replica index
kept in the line), and lines that belong to no model (the router's own) are kept as "router".
"""
from __future__ import annotations

import re
from collections import deque

LINE = re.compile(r"^\[(?P<name>[^\]#]+)#(?P<index>\d+)\] ?(?P<text>.*)$")
MAX_LINES = 2000
ROUTER = "router"


class ModelLogs:
    def __init__(self, max_lines: int = MAX_LINES) -> None:
        self.max_lines = max_lines
        self.logs: dict[str, deque[str]] = {}
        self._partial = ""

    def feed(self, text: str) -> set[str]:
        """Take a chunk of output (whole lines; a trailing partial line waits for the rest); returns the models
        that got lines."""
        complete, _, self._partial = (self._partial + text).rpartition("\n")
        touched = set()
        for line in complete.splitlines() if complete else ():
            match = LINE.match(line)
            name = match["name"] if match else ROUTER
            text_line = f"#{match['index']} {match['text']}" if match else line
            self.logs.setdefault(name, deque(maxlen=self.max_lines)).append(text_line)
            touched.add(name)
        return touched

    def lines(self, name: str) -> list[str]:
        return list(self.logs.get(name, ()))

    def clear(self) -> None:
        self.logs.clear()
        self._partial = ""
