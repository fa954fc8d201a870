"""Where the app keeps things: the user data directory (overridable with PAGEDESK_DATA_DIR), resources.

Tests and portable installs point PAGEDESK_DATA_DIR at their own folder; everyone else gets
platformdirs' per-user data directory for "PagedDesk". The repository root is also where
`python -m engine.entrypoints.serve` must be importable from, so the supervisor asks this module for it.
"""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs

DATA_DIR_ENV = "PAGEDESK_DATA_DIR"
REPO_ROOT = Path(__file__).resolve().parent.parent
RESOURCES = REPO_ROOT / "resources"
ICON_PATH = RESOURCES / "pagedesk.svg"


def data_dir() -> Path:
    """The per-user data directory, created on first use."""
    path = Path(os.environ.get(DATA_DIR_ENV) or platformdirs.user_data_dir("PagedDesk"))
    path.mkdir(parents=True, exist_ok=True)
    return path
