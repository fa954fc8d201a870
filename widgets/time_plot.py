"""Time-series plots fed from preallocated numpy ring buffers and redrawn on a timer.

`RingBuffer` keeps the last N samples of a few channels without allocating per sample; `TimePlot`
owns one, takes `append(t, values)` at any rate and calls `setData` on its curves only on its timer
tick (and only when something new arrived), with the x axis in seconds relative to the newest sample.
A NaN sample (`append_gap`) breaks the lines, so a period without data is not drawn as a slope. The
y axis starts at 0 and never shows less than one unit, and its label never gets an SI multiplier, so
an idle plot reads "0 … 1 tok/s" rather than "tok/s (x0.001)" with negative counts. Colours come
from the application palette, so the plots follow the window's light or dark theme. Plain data in,
pixels out: no app or engine imports.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QTimer
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QApplication, QWidget


def palette_colors() -> tuple[str, str]:
    """(background, foreground) of the application palette, for pyqtgraph views inside themed windows."""
    palette = QApplication.palette()
    return (palette.color(QPalette.ColorRole.Base).name(), palette.color(QPalette.ColorRole.Text).name())


class RingBuffer:
    """Fixed-capacity time series of `channels` float columns; oldest samples are overwritten."""

    def __init__(self, capacity: int, channels: int) -> None:
        assert capacity > 0 and channels > 0
        self.capacity = capacity
        self.channels = channels
        self._t = np.zeros(capacity)
        self._values = np.zeros((capacity, channels))
        self._next = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, t: float, values: Sequence[float]) -> None:
        self._t[self._next] = t
        self._values[self._next] = values
        self._next = (self._next + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(t, values) oldest first, as views when contiguous, copies when wrapped."""
        if self._size < self.capacity:
            return self._t[: self._size], self._values[: self._size]
        order = np.r_[self._next: self.capacity, 0: self._next]
        return self._t[order], self._values[order]

    def clear(self) -> None:
        self._next = self._size = 0


class TimePlot(pg.PlotWidget):
    """A plot of a few named series over the last `window_s` seconds, redrawn every `redraw_ms`; with
    `window_s=None`, over the whole recording from its first sample, the axis growing with it (a benchmark
    run of 3 s fills the plot as one of 10 minutes does)."""

    def __init__(self, title: str, series: Sequence[tuple[str, str]], unit: str = "", capacity: int = 2400,
                 window_s: float | None = 120.0, y_range: tuple[float, float] | None = None,
                 redraw_ms: int = 200, parent: QWidget | None = None) -> None:
        super().__init__(parent=parent)
        self.capacity = capacity
        self.window_s = window_s
        self.fixed_y_range = y_range
        self.title = title
        for side in ("left", "bottom"):
            self.getAxis(side).enableAutoSIPrefix(False)  # else an idle axis reads "(x0.001)", stale text stays
        self.apply_palette()
        self.setLabel("bottom", "time (s)" if window_s is not None else "time since start (s)")
        if unit:
            self.setLabel("left", unit)
        self.showGrid(x=True, y=True, alpha=0.15)
        self.setMouseEnabled(x=False, y=False)
        self.setMenuEnabled(False)
        self.setXRange(-window_s, 0, padding=0) if window_s is not None else self.setXRange(0, 1, padding=0)
        self.setYRange(*(y_range or (0, 1)), padding=0.02)
        self.legend = self.addLegend(offset=(8, 8), labelTextSize="8pt", labelTextColor=self.foreground,
                                     brush=pg.mkBrush(pg.mkColor(palette_colors()[0]).darker(105)))
        self.setClipToView(True)
        self.curves: list[pg.PlotDataItem] = []
        self.set_series(series)
        self._dirty = False
        self.redraw_count = 0
        self._timer = QTimer(self, interval=redraw_ms, timeout=self.redraw)
        self._timer.start()

    def set_title(self, title: str) -> None:
        self.title = title
        self.setTitle(title, size="10pt", color=self.foreground)

    def apply_palette(self) -> None:
        """Take background and text colours from the application palette (again, when the theme changes)."""
        background, self.foreground = palette_colors()
        self.setBackground(background)
        self.set_title(self.title)
        for side in ("left", "bottom"):
            self.getAxis(side).setTextPen(self.foreground)
            self.getAxis(side).setPen(self.foreground)

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 (Qt's name)
        super().changeEvent(event)
        built = "title" in self.__dict__  # Qt sends a palette change from inside the base constructor too
        if built and event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self.apply_palette()

    def set_series(self, series: Sequence[tuple[str, str]]) -> None:
        """Replace the curves (e.g. when the number of GPUs becomes known); clears the history."""
        for curve in self.curves:
            self.removeItem(curve)
        self.legend.clear()
        self.buffer = RingBuffer(self.capacity, max(1, len(series)))
        self.curves = [self.plot([], [], name=name, pen=pg.mkPen(color, width=2), connect="finite")
                       for name, color in series]
        self.legend.setVisible(bool(series))

    def append(self, t: float, values: Sequence[float]) -> None:
        """Record one sample (no drawing here; the timer draws)."""
        self.buffer.append(t, values)
        self._dirty = True

    def append_gap(self, t: float) -> None:
        """Mark a time without data (engine down): the lines break here instead of bridging it."""
        if len(self.buffer) and not np.isnan(self.buffer.arrays()[1][-1]).all():
            self.append(t, [np.nan] * self.buffer.channels)

    def clear_data(self) -> None:
        self.buffer.clear()
        for curve in self.curves:
            curve.setData([], [])

    def redraw(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        t, values = self.buffer.arrays()
        if len(t) == 0:
            return
        x = t - t[-1] if self.window_s is not None else t - t[0]
        for i, curve in enumerate(self.curves):
            curve.setData(x, values[:, i])
        if self.window_s is None:
            self.setXRange(0, max(1.0, float(x[-1])), padding=0.02)
        if self.fixed_y_range is None:
            visible = values[x >= -self.window_s] if self.window_s is not None else values
            top = np.nanmax(visible) if visible.size and not np.isnan(visible).all() else 0.0
            self.setYRange(0, max(1.0, float(top) * 1.1), padding=0)
        self.redraw_count += 1

    def last_values(self) -> np.ndarray | None:
        t, values = self.buffer.arrays()
        return values[-1].copy() if len(t) else None
