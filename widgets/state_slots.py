"""State-slot strip: a hybrid model's per-sequence linear-attention states, one cell per slot of the state pool.

Gated DeltaNet layers (Qwen3.5/3.6, Qwen3-Next) keep a fixed-size conv + recurrent state per running sequence
instead of K/V per token, so those states live in their own pool beside the block pool. This strip shows
each slot as a cell: free, held by a running request (in that request's block-map colour, so a request's
blocks and its state read as one), or a prefix-cache snapshot (the state at a cached block boundary, in the
cached-block colour). The slots are laid out to fill the strip's shape (a few columns when it is tall, more
when it is wide), so a pool of twenty slots is a block of readable cells, not a sliver. A summary line counts
them and their bytes; hovering a cell names its slot and owner. Plain data in, pixels out: no app or engine
imports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QLabel, QToolTip, QVBoxLayout, QWidget

from widgets.block_map import CACHED_RGBA, free_color, grid_columns, owner_palette
from widgets.themed_view import ThemedView

SLOT_FREE, SLOT_SEQUENCE, SLOT_SNAPSHOT = 0, 1, 2
MIN_WIDTH = 150  # px: beside the block map the strip keeps room for readable cells
_PALETTE = owner_palette()  # the block map's owner colours, so a request's blocks and state match


@dataclass
class StateSlotsPicture:
    """One snapshot of the state pool: per slot its kind and owner (0 none, k → owners[k-1])."""

    kind: np.ndarray  # uint8, SLOT_*
    owner: np.ndarray  # uint16
    owners: list[str] = field(default_factory=list)
    max_snapshots: int = 0
    slot_bytes: int = 0

    def __post_init__(self) -> None:
        assert self.kind.shape == self.owner.shape

    @property
    def num_slots(self) -> int:
        return int(self.kind.shape[0])

    def count(self, kind: int) -> int:
        return int(np.count_nonzero(self.kind == kind))


def slot_colors(picture: StateSlotsPicture, free_rgba: tuple[int, int, int, int]) -> np.ndarray:
    """(slots, 4) uint8: free, the owning request's colour (as in the block map), or the cached colour."""
    rgba = np.empty((picture.num_slots, 4), np.uint8)
    rgba[:] = free_rgba
    held = picture.kind == SLOT_SEQUENCE
    rgba[held] = _PALETTE[picture.owner[held].astype(np.int64) % len(_PALETTE)]
    rgba[picture.kind == SLOT_SNAPSHOT] = CACHED_RGBA
    return rgba


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


class StateSlotsWidget(ThemedView):
    """A few columns of state-pool cells with a summary above; redrawn on a timer when a new picture arrived."""

    def __init__(self, parent: QWidget | None = None, redraw_ms: int = 200) -> None:
        super().__init__(parent, redraw_ms)
        self.picture: StateSlotsPicture | None = None
        self._dirty = False
        self.columns = 4
        self.setMinimumWidth(MIN_WIDTH)
        self.summary = QLabel("State slots", wordWrap=True)
        self.plot = self.view.addViewBox(lockAspect=True, enableMouse=False, invertY=True)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.image)
        self.view.scene().sigMouseMoved.connect(self._on_mouse_moved)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.summary)
        layout.addWidget(self.view, 1)
        self.setToolTip("State slots of the linear-attention layers: one per running sequence, plus the prefix "
                        "cache's snapshots of the state at cached block boundaries")
        self.start_redrawing()

    def apply_palette(self) -> None:
        super().apply_palette()
        self._dirty = self.picture is not None  # free cells take the new theme's colour

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        self._dirty = self.picture is not None  # lay the slots out for the new shape

    def set_slots(self, picture: StateSlotsPicture) -> None:
        self.picture = picture
        self._dirty = True

    def image_array(self) -> np.ndarray | None:
        if self.picture is None:
            return None
        rgba = slot_colors(self.picture, free_color())
        rows = max(1, math.ceil(self.picture.num_slots / self.columns))
        image = np.zeros((rows * self.columns, 4), np.uint8)
        image[: self.picture.num_slots] = rgba
        return image.reshape(rows, self.columns, 4)

    def summary_text(self) -> str:
        p = self.picture
        if p is None:
            return "State slots"
        held, snaps = p.count(SLOT_SEQUENCE), p.count(SLOT_SNAPSHOT)
        text = f"State slots: {held} of {p.num_slots} held · {snaps}/{p.max_snapshots} snapshots"
        return text + (f" · {_mib(p.slot_bytes)} each" if p.slot_bytes else "")

    def redraw(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        if self.picture is not None:
            size = self.view.size()
            aspect = min(4.0, max(0.25, size.width() / max(size.height(), 1))) if size.height() > 50 else 0.5
            self.columns = min(grid_columns(self.picture.num_slots, aspect), max(1, self.picture.num_slots))
        image = self.image_array()
        if image is not None:
            self.image.setImage(image, autoLevels=False)
            self.plot.autoRange(padding=0)
        self.summary.setText(self.summary_text())

    def slot_info(self, slot: int) -> str:
        p = self.picture
        if p is None or not 0 <= slot < p.num_slots:
            return ""
        kind = int(p.kind[slot])
        if kind == SLOT_SEQUENCE:
            k = int(p.owner[slot])
            who = p.owners[k - 1] if 0 < k <= len(p.owners) else f"request #{k}"
            return f"state slot {slot}: held by {who}"
        if kind == SLOT_SNAPSHOT:
            return f"state slot {slot}: prefix-cache snapshot (the state at a cached block boundary)"
        return f"state slot {slot}: free"

    def slot_at(self, x: float, y: float) -> int | None:
        if self.picture is None or x < 0 or y < 0 or x >= self.columns:
            return None
        slot = int(y) * self.columns + int(x)
        return slot if slot < self.picture.num_slots else None

    def _on_mouse_moved(self, scene_pos) -> None:
        point = self.plot.mapSceneToView(scene_pos)
        slot = self.slot_at(point.x(), point.y())
        if slot is not None:
            QToolTip.showText(self.view.mapToGlobal(self.view.mapFromScene(scene_pos)), self.slot_info(slot), self.view)
