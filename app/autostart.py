"""The "start serving at login" option: an XDG autostart entry (~/.config/autostart/pagedesk.desktop).

Desktop sessions that follow the XDG autostart spec (GNOME, KDE, Xfce, …) run the entry's Exec at
login; ours starts PagedDesk in the tray and serves the last model and those served alongside it
(`pagedesk --serve-at-login`).
The file is the whole state: present means on, so the option never disagrees with the session.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

ENTRY_NAME = "pagedesk.desktop"


def autostart_path() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "autostart" / ENTRY_NAME


def autostart_command() -> str:
    script = Path(sys.executable).with_name("pagedesk")
    argv = [str(script)] if script.is_file() else [sys.executable, "-m", "app"]
    return shlex.join([*argv, "--serve-at-login"])


def entry_text() -> str:
    return ("[Desktop Entry]\nType=Application\nName=PagedDesk (serve at login)\n"
            "Comment=Start the PagedDesk engine in the tray at login\n"
            f"Exec={autostart_command()}\nIcon=pagedesk\nTerminal=false\nX-GNOME-Autostart-enabled=true\n")


def autostart_enabled() -> bool:
    return autostart_path().is_file()


def set_autostart(enabled: bool) -> None:
    path = autostart_path()
    if enabled:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(entry_text())
    elif path.exists():
        path.unlink()
