"""ThemedView: a pyqtgraph view inside a widget that follows the application palette and redraws on a timer.

The small Monitor views (state slots, expert load) share this: `self.view` is their GraphicsLayoutWidget,
whose background follows the window's light or dark theme when the palette changes, and `redraw()` runs
every `redraw_ms` (each view draws only when a new picture arrived). No app or engine imports.
"""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QEvent, QTimer
from PySide6.QtWidgets import QWidget

from widgets.time_plot import palette_colors


class ThemedView(QWidget):
    def __init__(self, parent: QWidget | None = None, redraw_ms: int = 200) -> None:
        super().__init__(parent)
        self.view = pg.GraphicsLayoutWidget()
        self._timer = QTimer(self, interval=redraw_ms)
        self._timer.timeout.connect(self.redraw)

    def start_redrawing(self) -> None:
        """Once the subclass has built its items: theme the view and start the redraw timer."""
        self.apply_palette()
        self._timer.start()

    def apply_palette(self) -> None:
        self.view.setBackground(palette_colors()[0])

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 (Qt's name)
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self.apply_palette()
        super().changeEvent(event)

    def redraw(self) -> None:
        raise NotImplementedError
