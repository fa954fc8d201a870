"""Per-GPU readout: VRAM used/total, utilisation, temperature and power for each card, from plain data.

Shows one row per `GpuReading`, or a plain "No NVIDIA GPU detected" line (with the reason) when the
sampler reports that NVML is unavailable. Either way it also shows the engine's own memory figures
(weights and KV cache bytes) from the engine-state stream. It draws what it is given and never polls.
"""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtWidgets import QGridLayout, QGroupBox, QLabel, QProgressBar, QVBoxLayout, QWidget

GIB = 1024 ** 3


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One card at one moment, as NVML reports it."""

    index: int
    name: str
    memory_used: int  # bytes
    memory_total: int  # bytes
    utilization: int  # percent
    temperature: int  # °C
    power_w: float
    power_limit_w: float


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class _GpuRow:
    def __init__(self, grid: QGridLayout, row: int) -> None:
        self.name = QLabel()
        self.vram = QProgressBar()
        self.vram.setRange(0, 1000)
        self.util = QProgressBar()
        self.util.setRange(0, 100)
        self.details = QLabel()
        for col, widget in enumerate((self.name, self.vram, self.util, self.details)):
            grid.addWidget(widget, row, col)
        self.widgets = (self.name, self.vram, self.util, self.details)

    def show(self, r: GpuReading) -> None:
        self.name.setText(f"GPU {r.index}: {r.name}")
        self.vram.setValue(int(1000 * r.memory_used / max(r.memory_total, 1)))
        self.vram.setFormat(f"VRAM {format_bytes(r.memory_used)} / {format_bytes(r.memory_total)}")
        self.util.setValue(r.utilization)
        self.util.setFormat(f"util {r.utilization}%")
        self.details.setText(f"{r.temperature} °C · {r.power_w:.0f} / {r.power_limit_w:.0f} W")


class GpuPanel(QGroupBox):
    """GPU cards and engine memory; `set_readings` / `set_unavailable` / `set_engine_memory`."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("GPUs", parent)
        self.status = QLabel("Looking for NVIDIA GPUs…")
        self.engine_memory = QLabel("Engine memory: engine not running")
        self._grid = QGridLayout()
        self._rows: list[_GpuRow] = []
        layout = QVBoxLayout(self)
        layout.addWidget(self.status)
        layout.addLayout(self._grid)
        layout.addWidget(self.engine_memory)
        self.gpu_available: bool | None = None

    def set_readings(self, readings: list[GpuReading]) -> None:
        self.gpu_available = True
        while len(self._rows) < len(readings):
            self._rows.append(_GpuRow(self._grid, len(self._rows)))
        for row, reading in zip(self._rows, readings):
            row.show(reading)
        for extra in self._rows[len(readings):]:
            for w in extra.widgets:
                w.hide()
        self.status.setText(f"{len(readings)} NVIDIA GPU{'s' if len(readings) != 1 else ''}")

    def set_unavailable(self, reason: str) -> None:
        self.gpu_available = False
        for row in self._rows:
            for w in row.widgets:
                w.hide()
        self.status.setText(f"No NVIDIA GPU detected ({reason})" if reason else "No NVIDIA GPU detected")

    def set_engine_memory(self, weights_bytes: int | None, kv_cache_bytes: int | None, device: str = "") -> None:
        if weights_bytes is None and kv_cache_bytes is None:
            self.engine_memory.setText("Engine memory: engine not running")
            return
        where = f" on {device}" if device else ""
        self.engine_memory.setText(f"Engine memory{where}: weights {format_bytes(weights_bytes or 0)} · "
                                   f"KV cache {format_bytes(kv_cache_bytes or 0)}")
