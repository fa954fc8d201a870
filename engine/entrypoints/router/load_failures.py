"""LoadFailure: a model that failed to load, kept so that the next request is answered at once instead of with
another engine start.

An engine that exits while loading (corrupt weights, a broken config.json, a model it cannot run) costs a
start-up each time: seconds to minutes and hundreds of MiB. The router keeps the failure with its message,
shows the model as `failed` in /v1/models, and answers every request for it with that message (503
model_load_failed) until the model's folder changes (a file added, removed or rewritten: names, sizes and
modification times of its files) or a backoff expires (RETRY_AFTER_S, longer with each failure in a row).
POST /v1/models/NAME/load always tries again. Torch-free, like the rest of the router.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

RETRY_AFTER_S = (30.0, 60.0, 120.0, 300.0, 600.0)


def folder_fingerprint(path: str) -> tuple | None:
    """(name, size, mtime) of each file in the folder (symbolic links followed, as in the Hugging Face cache);
    None for what is not a folder (a hub repo id: only the backoff retries it)."""
    try:
        with os.scandir(path) as entries:
            files = []
            for entry in entries:
                try:
                    info = entry.stat()
                except OSError:  # a dangling link: its absence is part of the state
                    files.append((entry.name, -1, -1))
                    continue
                files.append((entry.name, info.st_size, info.st_mtime_ns))
    except OSError:
        return None
    return tuple(sorted(files))


@dataclass(frozen=True)
class LoadFailure:
    message: str
    fingerprint: tuple | None  # the folder when it failed
    retry_at: float  # time.monotonic() after which a request tries again
    count: int = 1  # failures in a row

    @classmethod
    def after(cls, previous: LoadFailure | None, message: str, fingerprint: tuple | None,
              now: float) -> LoadFailure:
        count = previous.count + 1 if previous is not None else 1
        return cls(message, fingerprint, now + RETRY_AFTER_S[min(count, len(RETRY_AFTER_S)) - 1], count)

    def holds(self, fingerprint: tuple | None, now: float) -> bool:
        """Still the answer: the folder is as it was and the backoff has not expired."""
        return now < self.retry_at and fingerprint == self.fingerprint
