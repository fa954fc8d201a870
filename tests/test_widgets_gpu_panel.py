"""GPU panel: one row per card from plain readings, and the plain no-GPU state."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

from widgets.gpu_panel import GIB, GpuPanel, GpuReading, format_bytes


def test_readings_and_unavailable(qtbot):
    panel = GpuPanel()
    qtbot.addWidget(panel)
    panel.set_readings([GpuReading(0, "RTX 4090", 6 * GIB, 24 * GIB, 87, 65, 300.0, 450.0),
                        GpuReading(1, "RTX 4090", 12 * GIB, 24 * GIB, 40, 58, 210.0, 450.0)])
    assert panel.status.text() == "2 NVIDIA GPUs"
    assert "6.00 GiB / 24.00 GiB" in panel._rows[0].vram.format()
    assert panel._rows[1].vram.value() == 500
    assert "65 °C" in panel._rows[0].details.text() and "300 / 450 W" in panel._rows[0].details.text()
    panel.set_unavailable("NVML unavailable: NVMLError_LibraryNotFound")
    assert panel.status.text().startswith("No NVIDIA GPU detected")
    panel.set_engine_memory(2 * GIB, GIB // 2, "cpu")
    assert "weights 2.00 GiB" in panel.engine_memory.text() and "512.00 MiB" in panel.engine_memory.text()
    assert format_bytes(512) == "512 B"
