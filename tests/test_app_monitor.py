"""The Monitor as a user reads it: idle axes without "(x0.001)" or negative counts, no "GPU 0" legend
under "no NVIDIA GPU", lines broken over the time the engine was down, a block map that zooms, pans
and fits back, and plots that share the window's palette (one theme, no dark island)."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

import numpy as np
from PySide6.QtCore import QPointF
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QApplication

from app.demo_data import demo_gpu_readings, demo_states
from app.monitor_panel import MonitorPanel


def test_idle_axes_read_plainly(qtbot):
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    monitor.show()
    qtbot.waitExposed(monitor)
    _, state = demo_states(num_samples=1)[0]
    state.prompt_tokens_per_s = state.generation_tokens_per_s = 0.0
    state.num_running = state.num_waiting = 0
    for t in range(20):
        monitor.on_state(state, now=float(t))
    for plot in (monitor.tokens_plot, monitor.queue_plot):
        plot.redraw()
        QApplication.processEvents()
        (_, _), (y_low, y_high) = plot.viewRange()
        assert y_low >= -0.05 and y_high >= 1.0  # no negative request counts, at least one unit tall
        assert "x0.001" not in plot.getAxis("left").labelString()
    assert monitor.tokens_plot.getAxis("left").labelString().count("tok/s") == 1


def test_no_gpu_means_no_gpu_legend(qtbot):
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    monitor.on_gpu_unavailable("NVML not found")
    assert monitor.vram_plot.curves == [] and not monitor.vram_plot.legend.isVisible()
    monitor.on_gpu_readings(demo_gpu_readings(), now=1.0)  # a card appears later: series come back
    assert len(monitor.vram_plot.curves) == 2 and monitor.vram_plot.legend.isVisible()


def test_lines_break_while_the_engine_is_down(qtbot):
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    states = demo_states(num_samples=6)
    for t, state in states[:3]:
        monitor.on_state(state, now=t)
    monitor.on_engine_stopped(now=states[2][0] + 0.1)
    monitor.on_engine_stopped(now=states[2][0] + 0.2)  # a second stop adds no second gap
    for t, state in states[3:]:
        monitor.on_state(state, now=t + 30)
    _t, values = monitor.kv_plot.buffer.arrays()
    assert np.isnan(values[:, 0]).sum() == 1 and np.isnan(values[3, 0])
    monitor.kv_plot.redraw()
    assert monitor.kv_plot.curves[0].opts["connect"] == "finite"


def test_block_map_zooms_and_fits_back(qtbot):
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    monitor.show()
    qtbot.waitExposed(monitor)
    _, state = demo_states(num_samples=1, num_blocks=16384)[0]
    block_map = monitor.block_map
    block_map.set_blocks(state.blocks)
    block_map.redraw()
    block_map.fit()
    box = block_map._box
    full = box.viewRange()
    assert box.state["mouseEnabled"] == [True, True]
    box.scaleBy((0.1, 0.1), center=QPointF(10, 10))  # what a wheel turn does
    zoomed = box.viewRange()
    assert zoomed[0][1] - zoomed[0][0] < 0.2 * (full[0][1] - full[0][0])
    block_map.fit_button.click()
    np.testing.assert_allclose(box.viewRange(), full, rtol=0.02)


def test_plots_follow_the_application_palette(qtbot):
    base = QApplication.palette().color(QPalette.ColorRole.Base).name()
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    assert monitor.kv_plot.backgroundBrush().color().name() == base


def test_model_specific_views_appear_only_for_their_models(qtbot):
    """A hybrid MoE model speculating: its state slots beside the block map (held cells in the request's
    block colour), acceptance per interval (a gap when no draft was verified), and the expert heat map with
    each layer's shares summing to 1. A plain dense model shows none of them."""
    import dataclasses

    from app.demo_data import demo_hybrid_moe_states
    from app.engine_state import parse_expert_load, parse_state_slots
    from widgets.state_slots import slot_colors
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    states = demo_hybrid_moe_states(num_samples=8)
    for t, state in states[:4]:
        monitor.on_state(state, now=t)
    assert not monitor.state_slots.isHidden() and not monitor.expert_heatmap.isHidden()
    assert not monitor.acceptance_plot.isHidden()
    _t, accepted = monitor.acceptance_plot.buffer.arrays()
    _t, length = monitor.accepted_length_plot.buffer.arrays()
    a, b = states[2][1].spec_decode, states[3][1].spec_decode
    drafts, proposed, took = (b[k] - a[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    assert accepted[-1, 0] == 100 * took / proposed and length[-1, 0] == 1 + took / drafts
    assert len(accepted) == 3  # the first sample is only the base of the next interval
    stalled = dataclasses.replace(states[3][1])
    monitor.on_state(stalled, now=10.0)  # no verify step since: a gap
    assert np.isnan(monitor.acceptance_plot.buffer.arrays()[1][-1, 0])
    shares = monitor.expert_heatmap.shares()
    assert shares.shape == (40, 256) and np.allclose(shares.sum(axis=1), 1.0)
    monitor.expert_heatmap.redraw()
    assert "hottest: layer" in monitor.expert_heatmap.title.text()
    slots = monitor.state_slots
    slots.redraw()
    picture = states[3][1].state_slots
    held = int(np.flatnonzero(picture.kind == 1)[0])
    owner = picture.owners[picture.owner[held] - 1]
    assert slots.slot_info(held) == f"state slot {held}: held by {owner}"
    assert "snapshot" in slots.slot_info(19) and slots.slot_info(picture.num_slots - 5).endswith("free")
    blocks = states[3][1].blocks
    block = int(np.flatnonzero((blocks.owner == picture.owner[held]) & (blocks.ref_count == 1))[0])
    monitor.block_map.redraw()
    block_rgba = monitor.block_map.image_array().reshape(-1, 4)[block]
    assert (slot_colors(picture, (0, 0, 0, 255))[held] == block_rgba).all()  # one request, one colour
    assert "4/4 snapshots" in slots.summary_text() and "61 MiB each" in slots.summary_text()
    dense = demo_states(num_samples=1)[0][1]
    monitor.on_state(dense, now=11.0)
    assert monitor.state_slots.isHidden() and monitor.expert_heatmap.isHidden() and monitor.acceptance_plot.isHidden()
    # the wire format: what engine/entrypoints/openai/engine_state.py sends parses back to the same pictures
    wire = {"num_slots": 3, "kind": [1, 0, 2], "owner": [2, 0, 0], "max_snapshots": 4, "slot_bytes": 8}
    parsed = parse_state_slots(wire, ["a", "b"])
    assert parsed.kind.tolist() == [1, 0, 2] and parsed.owners[parsed.owner[0] - 1] == "b"
    load = parse_expert_load({"num_experts": 2, "layers": [1, 3], "tokens": [[3, 1], [0, 4]]})
    assert load.layers == [1, 3] and load.tokens.tolist() == [[3, 1], [0, 4]]
    import pytest
    with pytest.raises(ValueError, match="expert_load"):
        parse_expert_load({"num_experts": 3, "layers": [0], "tokens": [[1, 2]]})


def test_a_big_pool_is_drawn_in_readable_cells(qtbot):
    """Issue 38, item 7: 16k blocks were a 1-2 px strip; now a cell stands for a few neighbouring blocks when
    there are more than fit at MIN_CELL_PX, and says so; hovering names the blocks it holds."""
    from widgets.block_map import MIN_CELL_PX
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    monitor.resize(1000, 700)
    monitor.show()
    qtbot.waitExposed(monitor)
    _, state = demo_states(num_samples=1, num_blocks=16384)[0]
    block_map = monitor.block_map
    block_map.set_blocks(state.blocks)
    block_map.redraw()
    k = block_map.blocks_per_cell
    rows, columns = block_map.image_array().shape[:2]
    view = block_map._view.size()
    assert k > 1 and f"one cell = {k} neighbouring blocks" in block_map.summary.text()
    assert min(view.width() / columns, view.height() / rows) >= MIN_CELL_PX * 0.9
    assert rows * columns >= 16384 / k
    assert block_map.cell_blocks(0.5, 0.5) == list(range(k))
    assert block_map.cell_info(block_map.cell_blocks(0.5, 0.5)).startswith(f"blocks 0–{k - 1}: ")
    block_map.used_only.setChecked(True)  # a few cells: large enough for borders between them
    xs, _ys = block_map._borders.getData()
    assert xs is not None and len(xs) > 0


def test_each_count_is_said_once_and_views_fit_the_machine(qtbot):
    from app.loaded_models import ModelRow
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    _, state = demo_states(num_samples=1)[0]
    monitor.on_state(state, now=1.0)
    holders = len(set(state.blocks.owner[(state.blocks.state == 1) & (state.blocks.owner > 0)].tolist()))
    assert "running" not in monitor.headline.text()
    assert monitor.queue_plot.title == f"Requests: {state.num_running} running, {state.num_waiting} waiting"
    monitor.block_map.redraw()
    assert f"held by {holders} requests" in monitor.block_map.summary.text()
    monitor.on_gpu_unavailable("NVML not found")  # CPU: no empty VRAM plot, three plots in one row
    assert monitor.vram_plot.isHidden() and monitor._grid.getItemPosition(
        monitor._grid.indexOf(monitor.tokens_plot))[:2] == (0, 2)
    monitor.on_gpu_readings(demo_gpu_readings(), now=2.0)
    assert not monitor.vram_plot.isHidden()
    monitor.block_map.hover_label.setText("block 7 · in use · owner chatcmpl-3e8 · ref count 1")
    monitor.set_models([ModelRow("a", "loaded", "CPU", 1, 64, "none"), ModelRow("b", "loaded", "CPU", 1, 64, "none")])
    monitor.model_selector.setCurrentIndex(1)
    assert monitor.block_map.hover_label.text().strip() == ""  # the other model's block is not this one's


def test_the_expert_heat_map_reads_with_centred_cells_and_a_colour_scale(qtbot):
    from app.demo_data import demo_hybrid_moe_states
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    t, state = demo_hybrid_moe_states(num_samples=2)[-1]
    monitor.on_state(state, now=t)
    heatmap = monitor.expert_heatmap
    heatmap.redraw()
    rect = heatmap.image.mapRectToParent(heatmap.image.boundingRect())
    assert (rect.left(), rect.top()) == (-0.5, -0.5) and (rect.width(), rect.height()) == (256, 40)
    low, high = heatmap.color_bar.levels()
    assert low == 0 and high == 100 * 3 / 256  # percent of the layer's tokens, an even router mid-scale
    ticks = heatmap.plot.getAxis("left")._tickLevels[0]
    assert all(float(value).is_integer() for value, _ in ticks) and ticks[1][1] == str(state.expert_load.layers[ticks[1][0]])


def test_image_blocks_decode_into_the_block_snapshot():
    """Issue 35: the engine-state document's `image_blocks` (ids) become the widget's per-block image flags."""
    from app.engine_state import decode_image_blocks
    image = decode_image_blocks([1, 5, 99], 8)
    assert image.tolist() == [False, True, False, False, False, True, False, False]
    assert decode_image_blocks(None, 8) is None and decode_image_blocks([], 8) is None


def test_parse_state_carries_image_blocks_to_the_block_map():
    import numpy as np
    from app.engine_state import encode_blocks, parse_state
    zeros = np.zeros(6, np.uint8)
    doc = {"num_blocks": 6, "blocks": encode_blocks(zeros, zeros, zeros.astype(np.uint16)), "image_blocks": [2, 3]}
    assert parse_state(doc).blocks.image.tolist() == [False, False, True, True, False, False]
    del doc["image_blocks"]
    assert parse_state(doc).blocks.image is None
