"""Before Qt starts: can a window open here, and if not, what to do instead.

Without a display Qt's xcb platform aborts the process (SIGABRT) with a hint to reinstall or to install
libxcb-cursor0, which misleads on a headless server where nothing is broken. `display_problem` looks first:
no DISPLAY and no WAYLAND_DISPLAY (a headless box, an ssh session without -X), or a display but not the X
libraries Qt's xcb plugin loads; it answers a message that names both ways on (`pagedesk-serve` for serving
without a window, or what to install for the window), or None. `app.main` prints it and exits before any
QApplication exists. A platform chosen on purpose (QT_QPA_PLATFORM=offscreen, vnc, ...) is left alone.
"""
from __future__ import annotations

import ctypes.util
import sys
from typing import Callable, Mapping

WINDOWED_PLATFORMS = ("", "xcb", "wayland", "wayland-egl")
# Qt 6's xcb plugin: each library and the Debian/Ubuntu package that has it.
XCB_LIBRARIES = {"xcb-cursor": "libxcb-cursor0", "xcb-icccm": "libxcb-icccm4", "xcb-image": "libxcb-image0",
                 "xcb-keysyms": "libxcb-keysyms1", "xcb-randr": "libxcb-randr0",
                 "xcb-render-util": "libxcb-render-util0", "xcb-shape": "libxcb-shape0", "xcb-xkb": "libxcb-xkb1",
                 "xkbcommon-x11": "libxkbcommon-x11-0"}
HEADLESS = ("To serve without a window, run the engine and its endpoint alone:\n"
            "    pagedesk-serve --model /path/to/model-folder --port 8000\n"
            "(any OpenAI client then uses http://127.0.0.1:8000/v1).")


def display_problem(env: Mapping[str, str], platform: str = sys.platform,
                    find_library: Callable[[str], str | None] = ctypes.util.find_library) -> str | None:
    """Why the window cannot open in this environment, with what to do; None when it can (or Qt was told where
    to draw)."""
    qpa = env.get("QT_QPA_PLATFORM", "").split(":")[0]
    if not platform.startswith("linux") or qpa not in WINDOWED_PLATFORMS:
        return None
    if not env.get("DISPLAY") and not env.get("WAYLAND_DISPLAY"):
        return ("pagedesk: no display to open a window on (neither DISPLAY nor WAYLAND_DISPLAY is set: a headless "
                f"machine, or ssh without -X).\n{HEADLESS}\nFor the window, start pagedesk in a desktop session, "
                "over `ssh -X`, or under `xvfb-run pagedesk`.")
    if env.get("WAYLAND_DISPLAY") and qpa != "xcb":
        return None  # Qt draws through Wayland: the X libraries do not matter
    missing = [package for library, package in XCB_LIBRARIES.items() if find_library(library) is None]
    if not missing:
        return None
    return (f"pagedesk: the display {env.get('DISPLAY')} is there, but Qt's X11 platform needs libraries this "
            f"machine lacks: {', '.join(missing)}.\nFor the window, install them (Debian/Ubuntu):\n"
            f"    sudo apt-get install {' '.join(missing)}\n{HEADLESS}")
