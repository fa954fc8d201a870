"""One theme for the whole window, following the system's light/dark preference.

`apply_theme` picks the Fusion style with a light or dark palette from Qt's colour-scheme hint (the
desktop's setting; PAGEDESK_THEME=light|dark overrides it) and `follow_system_theme` re-applies it
when the desktop switches. The plots and the block map take their colours from the application
palette (and re-read it on a palette change), so they match the rest of the window instead of
being a dark island in a light one. In the dark theme check boxes get a visible outline (Fusion draws an
unticked box darker than the dark window around it, so it all but vanished).
"""
from __future__ import annotations

import os

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

from app.paths import RESOURCES

THEME_ENV = "PAGEDESK_THEME"
_DARK = {QPalette.ColorRole.Window: "#2b2f37", QPalette.ColorRole.WindowText: "#e5e9f0",
         QPalette.ColorRole.Base: "#1f232a", QPalette.ColorRole.AlternateBase: "#2b2f37",
         QPalette.ColorRole.Text: "#e5e9f0", QPalette.ColorRole.Button: "#353a44",
         QPalette.ColorRole.ButtonText: "#e5e9f0", QPalette.ColorRole.Highlight: "#5e81ac",
         QPalette.ColorRole.HighlightedText: "#ffffff", QPalette.ColorRole.ToolTipBase: "#353a44",
         QPalette.ColorRole.ToolTipText: "#e5e9f0", QPalette.ColorRole.PlaceholderText: "#8a93a3",
         QPalette.ColorRole.Link: "#88c0d0"}


DARK_CHECKBOXES = """
QCheckBox::indicator { width: 13px; height: 13px; border: 1px solid #8a93a3; border-radius: 3px; background: #1f232a; }
QCheckBox::indicator:hover { border-color: #c0c8d4; }
QCheckBox::indicator:checked { background: #5e81ac; border-color: #81a1c1; image: url(%s); }
QCheckBox::indicator:disabled { border-color: #4c525e; }
QCheckBox::indicator:checked:disabled { background: #4c566a; border-color: #4c566a; }
"""


def system_prefers_dark(app: QApplication) -> bool:
    forced = os.environ.get(THEME_ENV, "").lower()
    if forced in ("light", "dark"):
        return forced == "dark"
    return app.styleHints().colorScheme() == Qt.ColorScheme.Dark


def dark_palette() -> QPalette:
    palette = QPalette()
    for role, color in _DARK.items():
        palette.setColor(role, QColor(color))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, QColor("#6b7280"))
    return palette


def apply_theme(app: QApplication) -> bool:
    """Style the application; returns True for dark."""
    dark = system_prefers_dark(app)
    app.setStyle("Fusion")
    app.setPalette(dark_palette() if dark else app.style().standardPalette())
    app.setStyleSheet(DARK_CHECKBOXES % (RESOURCES / "check.svg").as_posix() if dark else "")
    return dark


def is_dark() -> bool:
    return QApplication.palette().color(QPalette.ColorRole.Window).lightness() < 128


def follow_system_theme(app: QApplication) -> None:
    """Apply the theme now and again whenever the desktop's light/dark setting changes."""
    apply_theme(app)
    app.styleHints().colorSchemeChanged.connect(lambda _scheme: apply_theme(app))
