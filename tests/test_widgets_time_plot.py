"""Ring buffer order and wrap-around; the plot draws only on its timer, from the buffer."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

import numpy as np

from widgets.time_plot import RingBuffer, TimePlot


def test_ring_buffer_keeps_last_samples_in_order():
    rb = RingBuffer(4, 2)
    for i in range(6):
        rb.append(float(i), (i, 10 * i))
    t, v = rb.arrays()
    assert list(t) == [2, 3, 4, 5]
    assert list(v[:, 1]) == [20, 30, 40, 50]
    rb.clear()
    assert len(rb) == 0 and len(rb.arrays()[0]) == 0


def test_plot_redraws_on_timer_not_per_sample(qtbot):
    plot = TimePlot("x", [("a", "r"), ("b", "g")], redraw_ms=50)
    qtbot.addWidget(plot)
    for i in range(100):
        plot.append(i * 0.01, (i, -i))
    assert plot.redraw_count == 0
    qtbot.waitUntil(lambda: plot.redraw_count >= 1, timeout=2000)
    x, y = plot.curves[0].getData()
    assert x[-1] == 0 and np.isclose(x[0], -0.99) and y[-1] == 99
    count = plot.redraw_count
    qtbot.wait(150)  # nothing new: no redraw
    assert plot.redraw_count == count
    assert list(plot.last_values()) == [99, -99]
