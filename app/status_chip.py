"""The status bar's chip: engine state as a coloured pill, with the served model and the live URL.

One place decides the colours of the states, so the chip, the tray tooltip and the window title
agree. The URL shown is the one the engine really serves on (never the form's wish). With several models
behind the endpoint the tooltip lists each one's own state (loaded, loading, failed with its error).
"""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QWidget

STATE_COLORS = {"READY": "#3f8f4f", "STARTING": "#b7892a", "STOPPING": "#b7892a", "CRASHED": "#b8434f",
                "FAILED": "#b8434f", "STOPPED": "#6b7280"}


def status_text(state: str, model: str, url: str) -> str:
    """'READY · model · URL', leaving out what is not known."""
    return " · ".join(part for part in (state, model, url) if part)


MAX_CHIP_WIDTH = 460  # a long model name or URL is elided (full text in the tooltip): status messages keep room


class StatusChip(QLabel):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("status-chip")
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.setMaximumWidth(MAX_CHIP_WIDTH)
        self.state = ""
        self.full_text = ""

    def set_status(self, state: str, model: str = "", url: str = "", details: list[str] | tuple = ()) -> None:
        """`details`: lines for the tooltip under the chip's own text (each served model's state)."""
        self.state = state
        color = STATE_COLORS.get(state, STATE_COLORS["STOPPED"])
        self.full_text = f"● {status_text(state, model, url)}"
        self.setToolTip("\n".join([self.full_text, *details]))
        self.setText(self.fontMetrics().elidedText(self.full_text, Qt.TextElideMode.ElideMiddle, MAX_CHIP_WIDTH - 24))
        self.setStyleSheet(f"QLabel#status-chip {{ background: {color}; color: white; border-radius: 9px; "
                           "padding: 2px 10px; font-weight: bold; }")
