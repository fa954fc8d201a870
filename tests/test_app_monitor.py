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
