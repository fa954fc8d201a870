"""The Monitor tab: block map, time-series plots and GPU panel, fed from engine-state and NVML samples.

`on_state(EngineState)` hands the block snapshot to the block map and appends one sample to each
plot's ring buffer; `on_gpu_readings` / `on_gpu_unavailable` feed the GPU panel and its VRAM plot.
Nothing here draws per event: the widgets redraw on their own timers. When the engine stops, each
plot gets a gap so its lines break instead of bridging the downtime; without NVML there is no VRAM plot
at all (no empty quarter of the plots, no "GPU 0" legend under "no NVIDIA GPU"). Each count is said once:
running and waiting in the Requests plot's title (the scheduler's), the requests holding blocks under the
block map (from the blocks, which a cell of the map groups when there are more than fit readably). With
several models behind the endpoint, a selector above the block map says whose engine it shows
(`model_selected`: the main window re-points the engine-state stream); the plots start afresh for the new
model and the block map forgets what the pointer named. What only some models have appears only for
them: a hybrid model's state slots beside the block map, the prefix cache's CPU-RAM tier beside it too (how full,
what it restored), speculative decoding's acceptance rate and mean accepted length per interval (app/spec_rates.py),
and a mixture-of-experts model's expert-load heat map. A sleeping engine says so in the headline.
"""
from __future__ import annotations

import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QGridLayout, QHBoxLayout, QLabel, QSplitter, QVBoxLayout, QWidget

from app.engine_state import EngineState
from app.spec_rates import SpecRateTracker
from widgets.block_map import MIN_CELL_PX, BlockMapWidget
from widgets.expert_heatmap import ExpertHeatmap
from widgets.gpu_panel import GIB, GpuPanel, GpuReading
from widgets.host_tier import HostTierWidget
from widgets.state_slots import StateSlotsWidget
from widgets.time_plot import TimePlot

GPU_COLORS = ("#88c0d0", "#d08770", "#a3be8c", "#b48ead")


class MonitorPanel(QWidget):
    model_selected = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model_selector = QComboBox(visible=False)
        self.model_selector.setToolTip("Whose engine the block map and plots show")
        self.model_selector.currentIndexChanged.connect(self._on_model_picked)
        self.block_map = BlockMapWidget(min_cell_px=MIN_CELL_PX)
        self.kv_plot = TimePlot("KV cache usage", [("KV used %", "#88c0d0"), ("prefix hit %", "#a3be8c")],
                                unit="%", y_range=(0, 100))
        self.queue_plot = TimePlot("Requests", [("running", "#a3be8c"), ("waiting", "#ebcb8b")])
        self.tokens_plot = TimePlot("Throughput", [("prompt tok/s", "#b48ead"), ("generation tok/s", "#d08770")],
                                    unit="tok/s")
        self.vram_plot = TimePlot("VRAM used", [("GPU 0", GPU_COLORS[0])], unit="GiB")
        self.acceptance_plot = TimePlot("Speculative decoding: draft acceptance", [("accepted %", "#a3be8c")],
                                        unit="%", y_range=(0, 100))
        self.accepted_length_plot = TimePlot("Speculative decoding: tokens per verify step",
                                             [("mean accepted length", "#ebcb8b")], unit="tokens")
        self.spec_rates = SpecRateTracker()
        self.state_slots = StateSlotsWidget()
        self.state_slots.setMaximumWidth(280)
        self.expert_heatmap = ExpertHeatmap()
        self.host_tier = HostTierWidget()
        self.host_tier.setMaximumWidth(280)
        for widget in (self.state_slots, self.expert_heatmap, self.host_tier):
            widget.setVisible(False)  # shown for the models that have them
        self.gpu_panel = GpuPanel()
        self.headline = QLabel("Waiting for the engine-state stream…")
        self.samples = 0
        plots = QWidget()
        self._grid = QGridLayout(plots)
        self._grid.setContentsMargins(0, 0, 0, 0)
        for row in (0, 1):
            self._grid.setRowStretch(row, 1)
        self._speculating: bool | None = None
        self._placed_gpu: bool | None = None
        self._has_gpu = True  # until NVML says otherwise: then no VRAM plot
        self._place_plots(False)
        top = QWidget()
        top_layout = QVBoxLayout(top)
        top_layout.setContentsMargins(0, 0, 0, 0)
        header = QHBoxLayout()
        header.addWidget(self.headline, 1)
        header.addWidget(self.model_selector)
        top_layout.addLayout(header)
        pools = QHBoxLayout()
        pools.addWidget(self.block_map, 3)
        pools.addWidget(self.expert_heatmap, 2)
        pools.addWidget(self.state_slots)
        pools.addWidget(self.host_tier)
        top_layout.addLayout(pools, 1)
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(top)
        splitter.addWidget(plots)
        splitter.addWidget(self.gpu_panel)
        splitter.setSizes([380, 320, 110])
        QVBoxLayout(self).addWidget(splitter)

    def on_state(self, state: EngineState, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.samples += 1
        self.block_map.set_blocks(state.blocks)
        self.kv_plot.append(now, (100 * state.kv_cache_usage, 100 * state.prefix_cache_hit_rate))
        self.queue_plot.append(now, (state.num_running, state.num_waiting))
        self.queue_plot.set_title(f"Requests: {state.num_running} running, {state.num_waiting} waiting")
        self.tokens_plot.append(now, (state.prompt_tokens_per_s, state.generation_tokens_per_s))
        self.gpu_panel.set_engine_memory(state.weights_bytes, state.kv_cache_bytes, state.device)
        self._show_model_specifics(state, now)
        asleep = {1: " · <b>asleep</b> (weights in CPU RAM)", 2: " · <b>asleep</b> (weights dropped)"}.get(
            state.sleep_level, "")
        self.headline.setText(
            f"<b>{state.model}</b> on {state.device}{asleep} · "
            f"{state.num_blocks:,} blocks × {state.block_size} tokens · "
            f"preemptions {state.num_preemptions} · "
            f"{state.prompt_tokens_total:,} prompt / {state.generation_tokens_total:,} generated tokens")

    def _place_plots(self, speculating: bool) -> None:
        """2 × 2 plots (three in a row without a GPU: no VRAM plot), or two rows of three with the two
        speculative-decoding plots."""
        if (speculating, self._has_gpu) == (self._speculating, self._placed_gpu):
            return
        self._speculating, self._placed_gpu = speculating, self._has_gpu
        plots = [self.kv_plot, self.queue_plot, self.tokens_plot] + ([self.vram_plot] if self._has_gpu else [])
        spec = [self.acceptance_plot, self.accepted_length_plot]
        for plot in plots + spec + [self.vram_plot]:
            self._grid.removeWidget(plot)
        shown = plots + spec if speculating else plots
        columns = 2 if len(shown) == 4 else 3
        for i, plot in enumerate(shown):
            self._grid.addWidget(plot, i // columns, i % columns)
        self._grid.setRowStretch(1, 1 if len(shown) > columns else 0)  # one row of three: no empty second row
        for plot in spec:
            plot.setVisible(speculating)
        self.vram_plot.setVisible(self._has_gpu)

    def _show_model_specifics(self, state: EngineState, now: float) -> None:
        self.state_slots.setVisible(state.state_slots is not None)
        if state.state_slots is not None:
            self.state_slots.set_slots(state.state_slots)
        speculating = state.spec_decode is not None
        self._place_plots(speculating)
        rates = self.spec_rates.update(state.spec_decode)
        if rates is not None:
            self.acceptance_plot.append(now, (100 * rates.acceptance_rate,))
            self.accepted_length_plot.append(now, (rates.mean_accepted_length,))
        elif speculating:  # no verify step this interval: a gap, not a fall to zero
            for plot in (self.acceptance_plot, self.accepted_length_plot):
                plot.append_gap(now)
        self.host_tier.setVisible(state.kv_offload is not None)
        if state.kv_offload is not None:
            self.host_tier.set_tier(state.kv_offload)
        self.expert_heatmap.setVisible(state.expert_load is not None)
        if state.expert_load is not None:
            self.expert_heatmap.add_interval(state.expert_load, now)

    def on_gpu_readings(self, readings: list[GpuReading], now: float | None = None) -> None:
        self.gpu_panel.set_readings(readings)
        if not self._has_gpu:  # a card appeared after all
            self._has_gpu = True
            self.vram_plot.set_title("VRAM used")
            self._place_plots(bool(self._speculating))
        if len(readings) != len(self.vram_plot.curves):
            self.vram_plot.set_series([(f"GPU {r.index}", GPU_COLORS[i % len(GPU_COLORS)])
                                       for i, r in enumerate(readings)])
        self.vram_plot.append(time.monotonic() if now is None else now, [r.memory_used / GIB for r in readings])

    def on_gpu_unavailable(self, reason: str) -> None:
        self.gpu_panel.set_unavailable(reason)
        self.vram_plot.set_series([])
        self.vram_plot.set_title("VRAM used (no NVIDIA GPU detected)")
        self._has_gpu = False
        self._place_plots(bool(self._speculating))

    def on_engine_stopped(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for plot in (self.kv_plot, self.queue_plot, self.tokens_plot, self.acceptance_plot, self.accepted_length_plot):
            plot.append_gap(now)
        self.spec_rates.reset()
        self.block_map.clear_hover()
        self.headline.setText("Engine not running.")
        self.gpu_panel.set_engine_memory(None, None)

    def set_models(self, rows) -> None:
        """The loaded models (app.loaded_models.ModelRow): a selector when there are several to choose from."""
        names = [r.name for r in rows if r.loaded]
        current = self.model_selector.currentText()
        self.model_selector.blockSignals(True)
        self.model_selector.clear()
        self.model_selector.addItems(names)
        if current in names:
            self.model_selector.setCurrentText(current)
        self.model_selector.blockSignals(False)
        self.model_selector.setVisible(len(names) > 1)

    def _on_model_picked(self, _index: int) -> None:
        name = self.model_selector.currentText()
        if name:
            for plot in (self.kv_plot, self.queue_plot, self.tokens_plot, self.acceptance_plot,
                         self.accepted_length_plot):
                plot.clear_data()
            self.spec_rates.reset()
            self.expert_heatmap.clear()
            self.block_map.clear_hover()
            self.model_selected.emit(name)
