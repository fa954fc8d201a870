"""Block map: every physical KV-cache block as one coloured cell, drawn from plain numpy arrays.

The widget takes three arrays per snapshot (state, ref count, owner index) plus the owner names and
turns them into one RGBA image with vectorised numpy, so 50,000 blocks cost one `ImageItem.setImage`.
Snapshots may arrive at any rate; the image is rebuilt on a timer only when a new one is pending.
Hovering a cell shows its block id, state, owner and ref count, and its KV cache group when the model has
several (sliding-window and full-attention layers share the pool; the summary counts each group's blocks).
With several groups the in-use blocks are coloured by group kind (groups of one kind, e.g. four
"window 1024" groups, share a colour) under a legend of the kinds; "Colour by" switches back to one colour per
request. Blocks holding image tokens (a vision-language model's image placeholders) carry a mark over their colour,
named in the legend and the hover text. Given `min_cell_px` (the Monitor gives MIN_CELL_PX), the map keeps every cell at least that large on
screen while shown: when the pool has more
blocks than that allows (16k blocks in a few hundred pixels), one cell stands for several neighbouring
blocks, coloured by the most telling of them (in use, else cached, else free) and as strongly as they are
occupied; the summary says how many blocks a cell holds and hovering a cell names its range and what the
blocks in it hold. Cells large enough get thin borders, so a run of one request's blocks reads as blocks.
The wheel zooms and a drag pans; "Fit" returns to the whole pool. "Used only" draws just the blocks that
hold something (in use or cached), packed into their own grid; hovering still names the real block. The
summary counts the requests that hold blocks, from the blocks themselves. Its background follows
the application palette. It never imports app or engine code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QTimer, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QHBoxLayout, QLabel, QPushButton, QToolTip, QVBoxLayout,
                               QWidget)

from widgets.time_plot import palette_colors

STATE_FREE, STATE_IN_USE, STATE_CACHED = 0, 1, 2
STATE_NAMES = {STATE_FREE: "free", STATE_IN_USE: "in use", STATE_CACHED: "cached (reusable prefix)"}

FREE_RGBA = (46, 52, 64, 255)
FREE_LIGHT_RGBA = (216, 222, 233, 255)  # free blocks on a light theme: quiet, not a dark slab
CACHED_RGBA = (94, 129, 172, 255)
SHARED_RGBA = (235, 203, 139, 255)
PADDING_RGBA = (0, 0, 0, 0)
# KV cache group kinds, in the order their names first appear (full attention first, then windows, then state)
GROUP_RGBA = ((136, 192, 208, 255), (180, 142, 173, 255), (208, 135, 112, 255), (163, 190, 140, 255),
              (191, 97, 106, 255), (143, 188, 187, 255))
COLOUR_BY_GROUP, COLOUR_BY_REQUEST = "KV cache group", "request"
IMAGE_MARK_RGBA = (255, 255, 255, 230)  # the dot over a block holding image tokens, whatever its colour
MIN_CELL_PX = 6  # below this a cell is no longer a block one can point at: neighbours share a cell
BORDER_CELL_PX = 9  # from this size on, cells get borders


def owner_palette(size: int = 64) -> np.ndarray:
    """`size` well-separated saturated colours (golden-ratio hues), one per request slot."""
    hues = (np.arange(size) * 0.618033988749895) % 1.0
    rgba = np.empty((size, 4), np.uint8)
    for i, h in enumerate(hues):
        color = pg.hsvColor(float(h), sat=0.65, val=0.95)
        rgba[i] = (color.red(), color.green(), color.blue(), 255)
    return rgba


_PALETTE = owner_palette()


@dataclass
class BlockSnapshot:
    """One block-pool snapshot: per-block state, ref count and owner index (0 none, k → owners[k-1])."""

    state: np.ndarray  # uint8, STATE_*
    ref_count: np.ndarray  # uint8
    owner: np.ndarray  # uint16
    owners: list[str] = field(default_factory=list)
    group: np.ndarray | None = None  # uint8 per block: 0 none, g → group_names[g-1]; None with one group
    group_names: list[str] = field(default_factory=list)
    image: np.ndarray | None = None  # bool per block: holds image tokens; None when none does

    def __post_init__(self) -> None:
        assert self.state.shape == self.ref_count.shape == self.owner.shape
        assert self.group is None or self.group.shape == self.state.shape
        assert self.image is None or self.image.shape == self.state.shape

    @property
    def num_blocks(self) -> int:
        return int(self.state.shape[0])


def block_colors(state: np.ndarray, ref_count: np.ndarray, owner: np.ndarray,
                 free_rgba: tuple[int, int, int, int] = FREE_RGBA) -> np.ndarray:
    """(n, 4) uint8 colours: free, cached, in use (colour of the owning request) or shared (ref > 1)."""
    rgba = np.empty((state.shape[0], 4), np.uint8)
    rgba[:] = free_rgba
    rgba[state == STATE_CACHED] = CACHED_RGBA
    in_use = state == STATE_IN_USE
    rgba[in_use] = _PALETTE[owner[in_use].astype(np.int64) % len(_PALETTE)]
    rgba[in_use & (ref_count > 1)] = SHARED_RGBA
    return rgba


def group_kind(group_name: str) -> str:
    """"window 1024 · 13 layers" -> "window 1024": groups of one kind differ only in their layer count."""
    return group_name.split(" · ")[0]


def group_kinds(group_names: list[str]) -> tuple[list[str], np.ndarray]:
    """(distinct group kinds in order, per group index 0..len: its kind's index, -1 for "none")."""
    kinds = list(dict.fromkeys(group_kind(n) for n in group_names))
    return kinds, np.array([-1] + [kinds.index(group_kind(n)) for n in group_names], np.int64)


def group_colors(state: np.ndarray, group: np.ndarray, group_names: list[str],
                 free_rgba: tuple[int, int, int, int] = FREE_RGBA) -> np.ndarray:
    """(n, 4) uint8 colours with in-use blocks coloured by their group's kind; free and cached as by state."""
    rgba = np.empty((state.shape[0], 4), np.uint8)
    rgba[:] = free_rgba
    rgba[state == STATE_CACHED] = CACHED_RGBA
    _, kind_of = group_kinds(group_names)
    kind = kind_of[np.minimum(group.astype(np.int64), len(group_names))]
    in_use = (state == STATE_IN_USE) & (kind >= 0)
    rgba[in_use] = np.asarray(GROUP_RGBA, np.uint8)[kind[in_use] % len(GROUP_RGBA)]
    return rgba


def grid_columns(num_blocks: int, aspect: float = 2.5) -> int:
    """Columns for a near-`aspect` (width/height) grid of square cells."""
    return max(1, math.ceil(math.sqrt(max(num_blocks, 1) * aspect)))


def to_grid(rgba: np.ndarray, columns: int) -> np.ndarray:
    """Lay (n, 4) colours out row-major as a (rows, columns, 4) image, padding the last row."""
    rows = max(1, math.ceil(rgba.shape[0] / columns))
    image = np.empty((rows * columns, 4), np.uint8)
    image[:] = PADDING_RGBA
    image[: rgba.shape[0]] = rgba
    return image.reshape(rows, columns, 4)


def aggregate_cells(rgba: np.ndarray, state: np.ndarray, per_cell: int,
                    free_rgba: tuple[int, int, int, int] = FREE_RGBA) -> np.ndarray:
    """(ceil(n / per_cell), 4) colours, one per run of `per_cell` blocks: the first in-use block's colour, else the
    cached colour, else free; blended toward free by the share of the run's blocks that hold something."""
    n = state.shape[0]
    cells = -(-n // per_cell)
    padded = np.full(cells * per_cell, STATE_FREE, np.uint8)
    padded[:n] = state
    runs = padded.reshape(cells, per_cell)
    in_use, cached = runs == STATE_IN_USE, runs == STATE_CACHED
    first = np.minimum(np.arange(cells) * per_cell + in_use.argmax(axis=1), n - 1)
    out = np.empty((cells, 4), np.float64)
    out[:] = free_rgba
    out[cached.any(axis=1)] = CACHED_RGBA
    out[in_use.any(axis=1)] = rgba[first[in_use.any(axis=1)]]
    held = (in_use | cached).mean(axis=1, keepdims=True)
    strength = np.where(held > 0, 0.4 + 0.6 * held, 0.0)  # one block of eight still shows
    free = np.asarray(free_rgba, np.float64)
    return (free + (out - free) * strength).round().astype(np.uint8)


def image_cells(image: np.ndarray | None, shown_ids: np.ndarray | None, per_cell: int) -> np.ndarray:
    """Indices of the cells holding at least one image block, for the cells as drawn (after "Used only" and after
    neighbouring blocks share a cell)."""
    if image is None:
        return np.zeros(0, np.int64)
    marked = image[shown_ids] if shown_ids is not None else image
    return np.unique(np.flatnonzero(marked) // per_cell)


def free_color() -> tuple[int, int, int, int]:
    """Free blocks' colour for the application palette: dark on a dark theme, light on a light one."""
    return FREE_RGBA if pg.mkColor(palette_colors()[0]).lightness() < 128 else FREE_LIGHT_RGBA


def _paint_swatch(swatch: QLabel, rgba: tuple) -> None:
    r, g, b = rgba[:3]
    swatch.setStyleSheet(f"background: rgb({r},{g},{b}); border: 1px solid #555;")


class BlockMapWidget(QWidget):
    """A grid of KV blocks coloured by state with a legend, a summary line and hover details."""

    hovered = Signal(str)

    def __init__(self, parent: QWidget | None = None, redraw_ms: int = 200, min_cell_px: int = 0) -> None:
        super().__init__(parent)
        self.min_cell_px = min_cell_px  # 0: one cell per block, however small
        self._snapshot: BlockSnapshot | None = None
        self._pending = False
        self._columns = 1
        self._shown_ids: np.ndarray | None = None  # block id of each cell while "Used only" is on
        self.blocks_per_cell = 1  # > 1 while the pool has more blocks than readable cells
        self._free_rgba = free_color()
        self._view = pg.GraphicsLayoutWidget()
        self._view.setBackground(palette_colors()[0])
        self._box = self._view.addViewBox(lockAspect=True, enableMouse=True, invertY=True)
        self._box.setMenuEnabled(False)
        self._image = pg.ImageItem(axisOrder="row-major")
        self._box.addItem(self._image)
        self._borders = pg.PlotCurveItem(connect="pairs", antialias=False)  # thin lines between large cells
        self._box.addItem(self._borders)
        self._image_marks = pg.ScatterPlotItem(symbol="o", pen=pg.mkPen(30, 30, 30, 200), brush=pg.mkBrush(*IMAGE_MARK_RGBA),
                                               pxMode=False)  # the dark rim keeps it visible on pale colours
        self._box.addItem(self._image_marks)  # one dot per cell holding image tokens, over the cell's colour
        self.image_cells = np.zeros(0, np.int64)  # the cells marked now
        self._view.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.summary = QLabel("No engine state yet")
        self.hover_label = QLabel(" ")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self._view, 1)
        layout.addLayout(self._legend())
        self._group_row = QHBoxLayout()  # one swatch per group kind, built when a snapshot has groups
        self._group_kinds: list[str] = []
        layout.addLayout(self._group_row)
        layout.addWidget(self.summary)
        hover_row = QHBoxLayout()
        hover_row.addWidget(self.hover_label, 1)
        hover_row.addWidget(QLabel("wheel: zoom · drag: pan"))
        self.colour_by_label = QLabel("Colour by")
        self.colour_by = QComboBox()
        self.colour_by.addItems([COLOUR_BY_GROUP, COLOUR_BY_REQUEST])
        self.colour_by.currentTextChanged.connect(self._on_colour_by)
        for w in (self.colour_by_label, self.colour_by):
            w.setVisible(False)  # only models with several KV cache groups have a choice
            hover_row.addWidget(w)
        self.used_only = QCheckBox("Used only", toolTip="Draw only the blocks in use or cached, packed together")
        self.used_only.toggled.connect(self._on_used_only)
        hover_row.addWidget(self.used_only)
        self.fit_button = QPushButton("Fit", clicked=self.fit)
        hover_row.addWidget(self.fit_button)
        layout.addLayout(hover_row)
        self._timer = QTimer(self, interval=redraw_ms, timeout=self.redraw)
        self._timer.start()

    def clear_hover(self) -> None:
        """Forget what the pointer last named (another model's pool is coming)."""
        self.hover_label.setText(" ")

    def _legend(self) -> QHBoxLayout:
        row = QHBoxLayout()
        entries = [("free", self._free_rgba), ("in use (colour per request)", tuple(_PALETTE[1])),
                   ("cached, reusable", CACHED_RGBA), ("shared, ref > 1", SHARED_RGBA)]
        self._swatches = []
        self._request_entries = []  # the entries that mean nothing while colouring by KV cache group
        for text, rgba in entries:
            swatch = QLabel()
            swatch.setFixedSize(12, 12)
            _paint_swatch(swatch, rgba)
            self._swatches.append(swatch)
            label = QLabel(text)
            row.addWidget(swatch)
            row.addWidget(label)
            row.addSpacing(10)
            if rgba in (tuple(_PALETTE[1]), SHARED_RGBA):
                self._request_entries += [swatch, label]
        mark = QLabel("●")
        mark.setStyleSheet("color: rgb({},{},{}); background: rgb(94,129,172); padding: 0 2px;".format(
            *IMAGE_MARK_RGBA[:3]))
        self.image_legend = QLabel("holds image tokens")
        row.addWidget(mark)
        row.addWidget(self.image_legend)
        row.addStretch(1)
        return row

    def _on_colour_by(self, _text: str) -> None:
        self._pending = self._snapshot is not None
        self._sync_group_legend(self._snapshot)

    def colouring_by_group(self, snap: BlockSnapshot | None) -> bool:
        return snap is not None and snap.group is not None and len(snap.group_names) > 1 and \
            self.colour_by.currentText() == COLOUR_BY_GROUP

    def group_legend(self) -> list[str]:
        """The group kinds the legend shows now (empty when colouring by request)."""
        return list(self._group_kinds)

    def _sync_group_legend(self, snap: BlockSnapshot | None) -> None:
        has_groups = snap is not None and snap.group is not None and len(snap.group_names) > 1
        for w in (self.colour_by_label, self.colour_by):
            w.setVisible(has_groups)
        kinds = group_kinds(snap.group_names)[0] if self.colouring_by_group(snap) else []
        for w in self._request_entries:
            w.setVisible(not kinds)
        if kinds == self._group_kinds:
            return
        self._group_kinds = kinds
        while self._group_row.count():
            item = self._group_row.takeAt(0)
            if item.widget() is not None:
                item.widget().hide()  # gone now, not when the event loop next deletes it
                item.widget().deleteLater()
        if not kinds:
            return
        self._group_row.addWidget(QLabel("in use, by KV cache group:"))
        for i, name in enumerate(kinds):
            swatch = QLabel()
            swatch.setFixedSize(12, 12)
            _paint_swatch(swatch, GROUP_RGBA[i % len(GROUP_RGBA)])
            self._group_row.addWidget(swatch)
            count = sum(group_kind(n) == name for n in snap.group_names)
            self._group_row.addWidget(QLabel(name + (f" (×{count} groups)" if count > 1 else "")))
            self._group_row.addSpacing(10)
        self._group_row.addStretch(1)

    def set_blocks(self, snapshot: BlockSnapshot) -> None:
        """Queue a snapshot; the next timer tick draws it (cheap to call at any rate)."""
        self._snapshot = snapshot
        self._pending = True

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 (Qt's name)
        super().changeEvent(event)
        if "_swatches" in self.__dict__ and event.type() in (QEvent.Type.PaletteChange,
                                                         QEvent.Type.ApplicationPaletteChange):
            self._view.setBackground(palette_colors()[0])
            self._free_rgba = free_color()
            _paint_swatch(self._swatches[0], self._free_rgba)
            self._pending = self._snapshot is not None

    def _on_used_only(self, _on: bool) -> None:
        self._pending = self._snapshot is not None
        self.redraw()
        self.fit()

    def fit(self) -> None:
        """Show the whole pool again after zooming or panning."""
        self._box.enableAutoRange()
        self._box.autoRange(padding=0)

    def redraw(self) -> None:
        if not self._pending or self._snapshot is None:
            return
        self._pending = False
        snap = self._snapshot
        self._sync_group_legend(snap)
        colors = group_colors(snap.state, snap.group, snap.group_names, self._free_rgba) \
            if self.colouring_by_group(snap) else \
            block_colors(snap.state, snap.ref_count, snap.owner, self._free_rgba)
        self._shown_ids = np.flatnonzero(snap.state != STATE_FREE) if self.used_only.isChecked() else None
        states = snap.state
        if self._shown_ids is not None:
            colors = colors[self._shown_ids] if len(self._shown_ids) else colors[:0]
            states = states[self._shown_ids]
        shown = len(colors) if self._shown_ids is not None else snap.num_blocks
        self.blocks_per_cell = self._blocks_per_cell(shown)
        if self.blocks_per_cell > 1:
            colors = aggregate_cells(colors, states, self.blocks_per_cell, self._free_rgba)
        cells = len(colors) if self.blocks_per_cell > 1 else shown
        self._columns = grid_columns(max(cells, 1), self._aspect())
        grid = to_grid(colors, self._columns)
        self._image.setImage(grid, autoLevels=False)
        self._draw_borders(grid.shape[0], self._columns)
        self._draw_image_marks(snap)
        text = self._summary_text(snap)
        if self.blocks_per_cell > 1:
            text += f"\none cell = {self.blocks_per_cell} neighbouring blocks (zoom in, or widen the window, for one each)"
        self.summary.setText(text)

    def _draw_image_marks(self, snap: BlockSnapshot) -> None:
        self.image_cells = image_cells(snap.image, self._shown_ids, self.blocks_per_cell)
        rows, cols = np.divmod(self.image_cells, self._columns)
        self._image_marks.setData(x=cols + 0.5, y=rows + 0.5, size=0.45)

    def _blocks_per_cell(self, num_blocks: int) -> int:
        """1 while each block can have a cell of `min_cell_px` on screen; else how many share one (only when shown:
        a hidden map has no size to fit)."""
        size = self._view.size()
        if not self.min_cell_px or not self._view.isVisible() or size.height() <= 50:
            return 1
        readable = max(1, (size.width() // self.min_cell_px) * (size.height() // self.min_cell_px))
        return max(1, math.ceil(num_blocks / readable))

    def _draw_borders(self, rows: int, columns: int) -> None:
        """Grid lines in the background colour when a cell is BORDER_CELL_PX or more on screen at full view."""
        size = self._view.size()
        cell_px = min(size.width() / max(columns, 1), size.height() / max(rows, 1))
        if cell_px < BORDER_CELL_PX or rows * columns > 20_000:
            self._borders.setData([], [])
            return
        xs = [c for x in range(columns + 1) for c in (x, x)] + [c for _ in range(rows + 1) for c in (0, columns)]
        ys = [c for _ in range(columns + 1) for c in (0, rows)] + [c for y in range(rows + 1) for c in (y, y)]
        self._borders.setData(xs, ys, pen=pg.mkPen(palette_colors()[0], width=1))

    def _aspect(self) -> float:
        """Width/height of the drawing area, so the cells fill it (clamped for tiny or hidden widgets)."""
        size = self._view.size()
        return min(8.0, max(0.5, size.width() / max(size.height(), 1))) if size.height() > 50 else 2.5

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._pending = self._snapshot is not None  # re-flow the grid to the new shape on the next tick

    def image_array(self) -> np.ndarray | None:
        return self._image.image

    @staticmethod
    def _summary_text(snap: BlockSnapshot) -> str:
        n = max(snap.num_blocks, 1)
        in_use = snap.state == STATE_IN_USE
        used = int(np.count_nonzero(in_use))
        cached = int(np.count_nonzero(snap.state == STATE_CACHED))
        shared = int(np.count_nonzero(in_use & (snap.ref_count > 1)))
        holders = len(np.unique(snap.owner[in_use & (snap.owner > 0)]))  # what the map shows, not a second count
        text = (f"{snap.num_blocks:,} blocks · {used:,} in use ({100 * used / n:.1f}%) · {cached:,} cached · "
                f"{shared:,} shared · held by {holders} request{'s' if holders != 1 else ''}")
        if snap.image is not None and snap.image.any():
            text += f" · {int(np.count_nonzero(snap.image)):,} holding image tokens"
        if snap.group is not None and snap.group_names:
            counts = np.bincount(snap.group.astype(np.int64), minlength=len(snap.group_names) + 1)
            text += "\nin use by KV cache group: " + " · ".join(
                f"{name}: {int(counts[g + 1]):,}" for g, name in enumerate(snap.group_names))
        return text

    def block_info(self, block_id: int) -> str:
        """Text for one block: id, state, owner and ref count."""
        snap = self._snapshot
        if snap is None or not 0 <= block_id < snap.num_blocks:
            return ""
        state = int(snap.state[block_id])
        owner_index = int(snap.owner[block_id])
        owner = snap.owners[owner_index - 1] if 0 < owner_index <= len(snap.owners) else "—"
        text = (f"block {block_id} · {STATE_NAMES.get(state, state)} · owner {owner} · "
                f"ref count {int(snap.ref_count[block_id])}")
        group = int(snap.group[block_id]) if snap.group is not None else 0
        if 0 < group <= len(snap.group_names):
            text += f" · group {snap.group_names[group - 1]}"
        if snap.image is not None and snap.image[block_id]:
            text += " · holds image tokens"
        return text

    def cell_blocks(self, x: float, y: float) -> list[int]:
        """The block ids in the cell under image coordinates (x = column, y = row): one, several while blocks
        share cells, none outside the pool."""
        if self._snapshot is None or x < 0 or y < 0 or x >= self._columns:
            return []
        cell = int(y) * self._columns + int(x)
        shown = len(self._shown_ids) if self._shown_ids is not None else self._snapshot.num_blocks
        positions = range(cell * self.blocks_per_cell, min((cell + 1) * self.blocks_per_cell, shown))
        if self._shown_ids is not None:
            return [int(self._shown_ids[p]) for p in positions]
        return list(positions)

    def block_at(self, x: float, y: float) -> int | None:
        """Block id under image coordinates (the first of its cell's), or None outside the pool."""
        blocks = self.cell_blocks(x, y)
        return blocks[0] if blocks else None

    def cell_info(self, blocks: list[int]) -> str:
        """One block's text, or for a cell of several: their range and what they hold."""
        if len(blocks) <= 1:
            return self.block_info(blocks[0]) if blocks else " "
        snap = self._snapshot
        ids = np.asarray(blocks)
        states = snap.state[ids]
        owners = sorted({snap.owners[o - 1] for o in snap.owner[ids] if 0 < o <= len(snap.owners)})
        counts = [f"{int(np.count_nonzero(states == k))} {STATE_NAMES[k].split(' (')[0]}" for k in STATE_NAMES
                  if np.count_nonzero(states == k)]
        return (f"blocks {blocks[0]}–{blocks[-1]}: " + ", ".join(counts) +
                (f" · owners {', '.join(owners[:3])}" + (" …" if len(owners) > 3 else "") if owners else ""))

    def _on_mouse_moved(self, scene_pos) -> None:
        point = self._box.mapSceneToView(scene_pos)
        blocks = self.cell_blocks(point.x(), point.y())
        block_id = blocks[0] if blocks else None
        text = self.cell_info(blocks)
        self.hover_label.setText(text)
        if block_id is not None:
            QToolTip.showText(self._view.mapToGlobal(self._view.mapFromScene(scene_pos)), text, self)
            self.hovered.emit(text)
