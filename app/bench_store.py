"""Benchmark runs kept in SQLite under the user's data directory (app.paths.data_dir()/benchmarks.sqlite3).

One table: each run's label, load configuration, summary figures (`ServeSummary.to_dict()`) and curves
(latency percentiles 1..99 and a per-request timeline) as JSON, so the Benchmark tab can list past runs
and overlay two of them. Small synchronous queries on a local file, like app/chat_store.py.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY, created REAL NOT NULL, label TEXT NOT NULL, config TEXT NOT NULL,
    summary TEXT NOT NULL, curves TEXT NOT NULL);
"""


@dataclass(frozen=True, slots=True)
class StoredRun:
    id: int
    created: float
    label: str
    config: dict
    summary: dict


class BenchStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db = sqlite3.connect(self.path)
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    def save(self, label: str, config: dict, summary: dict, curves: dict) -> int:
        with self._db:
            cur = self._db.execute("INSERT INTO runs (created, label, config, summary, curves) VALUES (?, ?, ?, ?, ?)",
                                   (time.time(), label, json.dumps(config), json.dumps(summary), json.dumps(curves)))
        return int(cur.lastrowid)

    def runs(self) -> list[StoredRun]:
        rows = self._db.execute("SELECT id, created, label, config, summary FROM runs ORDER BY id DESC")
        return [StoredRun(i, created, label, json.loads(config), json.loads(summary))
                for i, created, label, config, summary in rows]

    def curves(self, run_id: int) -> dict:
        row = self._db.execute("SELECT curves FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise KeyError(f"no benchmark run with id {run_id}")
        return json.loads(row[0])

    def delete(self, run_id: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM runs WHERE id = ?", (run_id,))
