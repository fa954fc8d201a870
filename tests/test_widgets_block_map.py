"""Block map: colours per state, grid layout, hover text, and a 50,000-block redraw (its speed is a figure
for benchmarks, never asserted here: a loaded machine is not a slow widget)."""

import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

import numpy as np
import pytest
from PySide6.QtCore import QPointF

from widgets.block_map import (CACHED_RGBA, FREE_RGBA, GROUP_RGBA, SHARED_RGBA, STATE_CACHED, STATE_IN_USE,
                               BlockMapWidget, BlockSnapshot, block_colors, grid_columns, group_colors, to_grid)


def snapshot(n=10):
    state = np.zeros(n, np.uint8)
    ref = np.zeros(n, np.uint8)
    owner = np.zeros(n, np.uint16)
    state[0:3], ref[0:3], owner[0:3] = STATE_IN_USE, 1, 1
    state[3:5], ref[3:5], owner[3:5] = STATE_IN_USE, 1, 2
    state[5], ref[5], owner[5] = STATE_IN_USE, 3, 1
    state[6] = STATE_CACHED
    return BlockSnapshot(state, ref, owner, ["cmpl-a", "cmpl-b"])


def test_colours_follow_state_owner_and_sharing():
    s = snapshot()
    rgba = block_colors(s.state, s.ref_count, s.owner)
    assert tuple(rgba[9]) == FREE_RGBA
    assert tuple(rgba[6]) == CACHED_RGBA
    assert tuple(rgba[5]) == SHARED_RGBA
    assert (rgba[0] == rgba[2]).all()  # same request, same colour
    assert not (rgba[0] == rgba[3]).all()  # different requests, different colours
    assert tuple(rgba[0]) not in (FREE_RGBA, CACHED_RGBA, SHARED_RGBA)


def test_grid_pads_last_row():
    rgba = np.full((10, 4), 7, np.uint8)
    grid = to_grid(rgba, 4)
    assert grid.shape == (3, 4, 4)
    assert (grid[2, 2:] == 0).all() and (grid[2, :2] == 7).all()
    assert grid_columns(50_000) * grid_columns(50_000) / 2.5 >= 50_000 / 2.5


def test_widget_draws_on_timer_and_reports_hover(qtbot):
    w = BlockMapWidget(redraw_ms=20)
    qtbot.addWidget(w)
    w.set_blocks(snapshot())
    qtbot.waitUntil(lambda: w.image_array() is not None, timeout=2000)
    assert w.image_array().shape[-1] == 4
    assert "10 blocks" in w.summary.text() and "2 requests" in w.summary.text()
    assert w.block_info(5) == "block 5 · in use · owner cmpl-a · ref count 3"
    assert "cached" in w.block_info(6) and "owner —" in w.block_info(6)
    cols = w._columns
    assert w.block_at(1.5, 0.2) == 1
    assert w.block_at(0.5, 1.5) == cols
    assert w.block_at(-1, 0) is None and w.block_at(0, 100) is None
    w.show()
    qtbot.waitExposed(w)
    w.redraw()  # re-flowed to the shown size
    cols = w._columns
    with qtbot.waitSignal(w.hovered, timeout=2000) as hovered:  # the real mouse-move path
        w._view.scene().sigMouseMoved.emit(w._box.mapViewToScene(QPointF(5 % cols + 0.5, 5 // cols + 0.5)))
    assert hovered.args[0].startswith("block 5 ·") and w.hover_label.text() == hovered.args[0]


@pytest.mark.parametrize("n", [50_000])
def test_fifty_thousand_blocks_redraw(qtbot, n):
    rng = np.random.default_rng(0)
    s = BlockSnapshot(rng.integers(0, 3, n).astype(np.uint8), rng.integers(0, 3, n).astype(np.uint8),
                      rng.integers(0, 200, n).astype(np.uint16), [f"r{i}" for i in range(200)])
    w = BlockMapWidget(redraw_ms=10_000)
    qtbot.addWidget(w)
    w.show()
    w.set_blocks(s)
    w.redraw()  # first draw builds the item
    for _ in range(5):
        w.set_blocks(s)
        w.redraw()
    img = w.image_array()
    assert img.shape[0] * img.shape[1] >= n


def grouped_snapshot():
    s = snapshot()
    group = np.zeros(10, np.uint8)
    group[0:3], group[3:5], group[5] = 1, 2, 3  # full, window, window (a second group of that kind)
    return BlockSnapshot(s.state, s.ref_count, s.owner, s.owners, group,
                         ["full attention · 2 layers", "window 8 · 2 layers", "window 8 · 1 layer"])


def test_colours_follow_the_kv_cache_group_kind():
    s = grouped_snapshot()
    rgba = group_colors(s.state, s.group, s.group_names)
    assert [tuple(rgba[i]) for i in (0, 3, 5)] == [GROUP_RGBA[0], GROUP_RGBA[1], GROUP_RGBA[1]]
    assert tuple(rgba[6]) == CACHED_RGBA and tuple(rgba[9]) == FREE_RGBA  # not in use: by state, as before


def test_widget_colours_by_group_with_a_legend_and_switches_to_requests(qtbot):
    w = BlockMapWidget(redraw_ms=10_000)
    qtbot.addWidget(w)
    w.set_blocks(snapshot())
    w.redraw()
    assert w.group_legend() == [] and not w.colour_by.isVisibleTo(w)  # one group: nothing to choose
    w.set_blocks(grouped_snapshot())
    w.redraw()
    assert w.colour_by.isVisibleTo(w) and w.group_legend() == ["full attention", "window 8"]
    labels = [w._group_row.itemAt(i).widget().text() for i in range(w._group_row.count())
              if w._group_row.itemAt(i).widget() is not None]
    assert "window 8 (×2 groups)" in labels and "full attention" in labels
    assert not any(e.isVisibleTo(w) for e in w._request_entries)  # the per-request legend is hidden
    assert tuple(w.image_array()[0, 3]) == GROUP_RGBA[1]
    w.colour_by.setCurrentText("request")
    w.redraw()
    assert all(e.isVisibleTo(w) for e in w._request_entries)
    assert w.group_legend() == [] and tuple(w.image_array()[0, 3]) == tuple(block_colors(
        w._snapshot.state, w._snapshot.ref_count, w._snapshot.owner)[3])


def test_used_only_packs_the_used_blocks_and_hover_names_the_real_block(qtbot):
    n = 16_384
    state, ref, owner = np.zeros(n, np.uint8), np.zeros(n, np.uint8), np.zeros(n, np.uint16)
    used = np.array([3, 700, 701, 9000, 16_383])
    state[used], ref[used], owner[used] = STATE_IN_USE, 1, 1
    state[12_000] = STATE_CACHED
    w = BlockMapWidget(redraw_ms=10_000)
    qtbot.addWidget(w)
    w.set_blocks(BlockSnapshot(state, ref, owner, ["cmpl-a"]))
    w.redraw()
    assert w.image_array().shape[0] * w.image_array().shape[1] >= n  # the whole pool
    w.used_only.setChecked(True)  # redraws at once
    image = w.image_array()
    expected = block_colors(state, ref, owner, w._free_rgba)
    assert image.shape[0] * image.shape[1] < 16 and (image.reshape(-1, 4)[4] == expected[12_000]).all()
    shown = [w.block_at(i % w._columns + 0.5, i // w._columns + 0.5) for i in range(6)]
    assert shown == [3, 700, 701, 9000, 12_000, 16_383]
    assert w.block_info(shown[3]).startswith("block 9000 · in use")
    w.used_only.setChecked(False)
    assert w.image_array().shape[0] * w.image_array().shape[1] >= n and w.block_at(0.5, 0.5) == 0


def test_blocks_holding_image_tokens_are_marked_named_and_in_the_legend(qtbot):
    """Issue 35, Monitor: a block holding image tokens carries a mark over its request's colour (the colour is
    kept), the hover text and summary say so, the legend names the mark, and "Used only" keeps the marks on the
    right cells."""
    s = snapshot()
    s.image = np.zeros(10, bool)
    s.image[[1, 2, 4]] = True
    w = BlockMapWidget(redraw_ms=10_000)
    qtbot.addWidget(w)
    w.set_blocks(s)
    w.redraw()
    assert w.image_cells.tolist() == [1, 2, 4]
    xs, ys = w._image_marks.getData()
    cols = w._columns
    assert sorted(zip(ys.tolist(), xs.tolist())) == sorted((c // cols + 0.5, c % cols + 0.5) for c in (1, 2, 4))
    assert (w.image_array().reshape(-1, 4)[1] == block_colors(s.state, s.ref_count, s.owner)[1]).all()
    assert w.block_info(2).endswith("· holds image tokens") and "image" not in w.block_info(3)
    assert "3 holding image tokens" in w.summary.text()
    assert w.image_legend.text() == "holds image tokens"
    s.state[0] = 0  # block 0 freed: "Used only" shifts every used block one cell left
    w.set_blocks(s)
    w.used_only.setChecked(True)
    assert w.image_cells.tolist() == [0, 1, 3]
    w.set_blocks(snapshot())  # no image blocks: no marks
    w.redraw()
    assert w.image_cells.tolist() == [] and len(w._image_marks.getData()[0]) == 0
