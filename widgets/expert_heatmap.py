"""Expert-usage heat map: how many tokens a mixture-of-experts model routes to each expert of each layer.

Each engine-state document carries the routed-token counts (top-k assignments) per MoE layer and expert
for the interval since the previous document. The map keeps an exponentially decayed sum of them (a
half-life of a few seconds), so it shows the recent load rather than one noisy interval or the whole
run, and colours each cell by its share of its layer's load: an even router is one flat colour, a hot
expert a bright cell; a colour bar beside the map reads colours back as percentages. Rows are layers,
columns experts, each cell centred on its whole-number tick (the left axis names the real layer numbers,
which skip a model's dense layers); hovering a cell names its layer, expert, share and tokens. Plain data
in, pixels out: no app or engine imports.
"""
from __future__ import annotations

from dataclasses import dataclass

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF
from PySide6.QtWidgets import QLabel, QToolTip, QVBoxLayout, QWidget

from widgets.themed_view import ThemedView

HALF_LIFE_S = 5.0
MAX_TICKS = 8  # labelled ticks per axis: every expert of 256 would be unreadable


def tick_step(count: int) -> int:
    """A whole step (1, 2, 5, 10, 20, ...) that labels at most MAX_TICKS of `count` cells."""
    for scale in (10 ** e for e in range(7)):
        for step in (1, 2, 5):
            if count / (step * scale) <= MAX_TICKS:
                return step * scale
    return max(1, count)


@dataclass
class ExpertLoad:
    """One interval's routed-token counts: tokens[i, e] for MoE layer layers[i] and expert e."""

    layers: list[int]
    tokens: np.ndarray  # int64 (len(layers), num_experts)

    def __post_init__(self) -> None:
        assert self.tokens.ndim == 2 and self.tokens.shape[0] == len(self.layers), self.tokens.shape

    @property
    def num_experts(self) -> int:
        return int(self.tokens.shape[1])


def layer_shares(load: np.ndarray) -> np.ndarray:
    """Each cell's share of its layer's load (rows sum to 1; an idle layer is all 0)."""
    total = load.sum(axis=1, keepdims=True)
    return np.divide(load, total, out=np.zeros_like(load, dtype=np.float64), where=total > 0)


class DecayedLoad:
    """An exponentially decayed sum of interval counts: older intervals fade with a half-life."""

    def __init__(self, half_life_s: float = HALF_LIFE_S) -> None:
        self.half_life_s = half_life_s
        self.load: np.ndarray | None = None
        self.layers: list[int] = []
        self._last: float | None = None

    def add(self, interval: ExpertLoad, now: float) -> None:
        counts = interval.tokens.astype(np.float64)
        if self.load is None or self.load.shape != counts.shape or self.layers != interval.layers:
            self.load, self.layers = counts, list(interval.layers)  # a new model: start afresh
        else:
            decay = 0.5 ** (max(0.0, now - (self._last or now)) / self.half_life_s)
            self.load = self.load * decay + counts
        self._last = now

    def clear(self) -> None:
        self.load, self.layers, self._last = None, [], None


class ExpertHeatmap(ThemedView):
    """Layers × experts, coloured by each expert's recent share of its layer's routed tokens."""

    def __init__(self, parent: QWidget | None = None, redraw_ms: int = 500) -> None:
        super().__init__(parent, redraw_ms)
        self.recent = DecayedLoad()
        self._dirty = False
        self.title = QLabel("Expert load (tokens routed per expert, recent)")
        self.plot = self.view.addPlot()
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(False, False)
        self.plot.invertY(True)
        self.plot.setLabel("bottom", "expert")
        self.plot.setLabel("left", "layer")
        self.image = pg.ImageItem(axisOrder="row-major")
        colormap = pg.colormap.get("viridis")
        self.image.setColorMap(colormap)
        self.plot.addItem(self.image)
        self.color_bar = pg.ColorBarItem(values=(0, 100), colorMap=colormap, label="% of the layer's tokens",
                                         interactive=False, width=12)
        self.color_bar.setImageItem(self.image, insert_in=self.plot)
        self._shape: tuple[int, int] | None = None
        self.view.scene().sigMouseMoved.connect(self._on_mouse_moved)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.title)
        layout.addWidget(self.view, 1)
        self.start_redrawing()

    def add_interval(self, interval: ExpertLoad, now: float) -> None:
        self.recent.add(interval, now)
        self._dirty = True

    def clear(self) -> None:
        self.recent.clear()
        self.image.clear()
        self._shape = None

    def shares(self) -> np.ndarray | None:
        return None if self.recent.load is None else layer_shares(self.recent.load)

    def redraw(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        shares = self.shares()
        if shares is None:
            return
        experts = shares.shape[1]
        # an even router gives every cell 1/E: scale so that reads mid-map and a hot expert saturates
        top = 100 * min(1.0, 3.0 / max(experts, 1))
        self.image.setImage(100 * shares, autoLevels=False, levels=(0.0, top))
        self.color_bar.setLevels((0.0, top))
        self._set_axes(shares.shape)
        hottest = np.unravel_index(int(np.argmax(shares)), shares.shape) if shares.any() else None
        text = f"Expert load: {len(self.recent.layers)} MoE layers × {experts} experts, last ~{HALF_LIFE_S * 2:g} s"
        if hottest is not None:
            layer = self.recent.layers[hottest[0]]
            text += f" · hottest: layer {layer} expert {hottest[1]} ({100 * shares[hottest]:.0f}% of its layer)"
        self.title.setText(text)

    def _set_axes(self, shape: tuple[int, int]) -> None:
        """Cells centred on whole numbers, whole-number ticks, the left axis in the model's layer numbers."""
        if shape == self._shape:
            return
        self._shape = rows, experts = shape
        self.image.setRect(QRectF(-0.5, -0.5, experts, rows))
        self.plot.setXRange(-0.5, experts - 0.5, padding=0)
        self.plot.setYRange(-0.5, rows - 0.5, padding=0)
        x_step, y_step = tick_step(experts), tick_step(rows)
        self.plot.getAxis("bottom").setTicks([[(e, str(e)) for e in range(0, experts, x_step)], []])
        self.plot.getAxis("left").setTicks([[(r, str(self.recent.layers[r])) for r in range(0, rows, y_step)], []])

    def cell_info(self, row: int, expert: int) -> str:
        load = self.recent.load
        if load is None or not (0 <= row < load.shape[0] and 0 <= expert < load.shape[1]):
            return ""
        share = layer_shares(load)[row, expert]
        return (f"layer {self.recent.layers[row]} · expert {expert}: {100 * share:.1f}% of the layer's recent tokens "
                f"({load[row, expert]:,.0f} decayed)")

    def _on_mouse_moved(self, scene_pos) -> None:
        point = self.plot.vb.mapSceneToView(scene_pos)
        row, expert = math.floor(point.y() + 0.5), math.floor(point.x() + 0.5)  # cells are centred on whole numbers
        info = self.cell_info(row, expert) if row >= 0 and expert >= 0 else ""
        if info:
            QToolTip.showText(self.view.mapToGlobal(self.view.mapFromScene(scene_pos)), info, self.view)
