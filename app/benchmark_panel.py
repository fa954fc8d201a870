"""The Benchmark tab: run a serving benchmark against the running engine and compare it with past runs.

Pick the load (rate or concurrency, request count, prompt/output lengths, share of long prompts), press
Run: the prompts are built to those token counts by the served model's own tokenizer and capped by its
context (engine/bench/serve_prompts.py), so no request is one the server must refuse; then
`BenchmarkRunner` drives the load off the GUI thread while two live plots show throughput (over the last
few seconds) and TTFT/ITL percentiles (over the requests finished so far), and a bar counts "n of N". A
failed request is told in the server's words. Each finished run lands in SQLite (app/bench_store.py) and in
the table of past runs (latencies in ms or s, whichever reads); selecting one or two rows overlays their
latency percentile curves.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QDoubleSpinBox, QFormLayout, QGroupBox, QHBoxLayout,
                               QHeaderView, QLabel, QLineEdit, QProgressBar, QPushButton, QSpinBox, QSplitter,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from app.bench_store import BenchStore, StoredRun
from app.benchmark_worker import BenchmarkResult, BenchmarkRunner, failure_words
from app.units import format_ms
from engine.bench.serve_client import RequestOutcome
from engine.bench.serve_load import ServeLoad
from engine.bench.serve_prompts import ServedTokenizer, served_requests
from widgets.time_plot import TimePlot, palette_colors

RATE_WINDOW_S = 5.0  # live throughput is averaged over this many seconds of finished requests
# The key figures first (the table may be narrow); the load's settings after them.
COLUMNS = ("label", "out tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "errors", "requests", "rate",
           "concurrency", "id")
OVERLAY_COLORS = ("#88c0d0", "#d08770")


class BenchmarkPanel(QWidget):
    def __init__(self, store: BenchStore, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.runner = BenchmarkRunner(self)
        self.base_url: str | None = None
        self.api_key: str | None = None
        self.max_model_len = 2048
        self.model: str | None = None  # whose tokenizer builds the prompts and who answers (None: the first listed)
        self._outcomes: list[RequestOutcome] = []
        self._done_at: list[float] = []
        self._started = 0.0
        self._config: dict = {}
        self._build()
        self.runner.preparing.connect(self._on_preparing)
        self.runner.outcome.connect(self._on_outcome)
        self.runner.finished.connect(self._on_finished)
        self.runner.failed.connect(self._on_failed)
        self.runner.idle.connect(lambda: self.run_button.setEnabled(self.base_url is not None))
        self.refresh_runs()
        self.set_endpoint(None)

    # ---- layout ---------------------------------------------------------------------------------------
    def _build(self) -> None:
        self.endpoint_kind = QComboBox()
        self.endpoint_kind.addItems(["completions", "chat"])
        self.num_requests = QSpinBox(minimum=1, maximum=100000, value=50)
        self.rate = QDoubleSpinBox(minimum=0.0, maximum=10000.0, value=2.0, decimals=2, singleStep=0.5,
                                   specialValueText="all at once")
        self.concurrency = QSpinBox(minimum=0, maximum=10000, value=0, specialValueText="unbounded")
        self.prompt_mean = QSpinBox(minimum=4, maximum=100000, value=160)
        self.output_len = QSpinBox(minimum=1, maximum=100000, value=64)
        self.long_percent = QSpinBox(minimum=0, maximum=100, value=0, suffix=" %")
        self.label = QLineEdit(placeholderText="optional", minimumWidth=140)
        self.label.setToolTip("A name for this run in the table of past runs (default: the time it ran)")
        form_box = QGroupBox("Load")
        form = QFormLayout(form_box)
        for name, widget in (("Endpoint", self.endpoint_kind), ("Requests", self.num_requests),
                             ("Request rate (req/s, Poisson)", self.rate), ("Max concurrency", self.concurrency),
                             ("Mean prompt tokens", self.prompt_mean), ("Output tokens", self.output_len),
                             ("Long prompts (1k-2k tokens)", self.long_percent), ("Label", self.label)):
            form.addRow(name, widget)
        self.run_button = QPushButton("Run", clicked=self.start_run)
        self.stop_button = QPushButton("Stop", clicked=self.runner.stop, enabled=False)
        self.progress = QProgressBar(visible=False)
        self.status = QLabel(wordWrap=True)
        # Room for three lines whatever it says, so a long error never pushes the form about.
        self.status.setMinimumHeight(3 * self.status.fontMetrics().lineSpacing())
        self.status.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.stop_button)
        form.addRow(buttons)
        form.addRow(self.progress)
        form.addRow(self.status)
        self.throughput_plot = TimePlot("Throughput (live)", [("req/s", "#a3be8c"), ("output tok/s ÷ 10", "#d08770")],
                                        window_s=None)  # the axes follow the run, however short
        self.latency_plot = TimePlot("Latency percentiles (live)", [("TTFT p50", "#88c0d0"), ("TTFT p99", "#5e81ac"),
                                                                     ("ITL p50", "#ebcb8b"), ("ITL p99", "#bf616a")],
                                     unit="ms", window_s=None)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.itemSelectionChanged.connect(self.update_overlay)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.verticalHeader().setVisible(False)
        self.overlay = pg.PlotWidget(background=palette_colors()[0],
                                     title="Past runs: latency by percentile (select 1–2)")
        self.overlay.setLabel("bottom", "percentile")
        self.overlay.setLabel("left", "ms")
        self.overlay.addLegend(offset=(8, 8), labelTextSize="8pt")
        top = QSplitter(Qt.Orientation.Horizontal)
        top.addWidget(form_box)
        top.addWidget(self.throughput_plot)
        top.addWidget(self.latency_plot)
        bottom = QSplitter(Qt.Orientation.Horizontal)
        bottom.addWidget(self.table)
        bottom.addWidget(self.overlay)
        bottom.setSizes([700, 500])  # the table's key figures visible without scrolling; the handle moves it
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(top)
        splitter.addWidget(bottom)
        QVBoxLayout(self).addWidget(splitter)

    # ---- engine --------------------------------------------------------------------------------------
    def set_endpoint(self, base_url: str | None, api_key: str | None = None, max_model_len: int | None = None,
                     model: str | None = None) -> None:
        self.base_url, self.api_key, self.model = base_url, api_key, model
        self.max_model_len = max_model_len or self.max_model_len
        self.run_button.setEnabled(base_url is not None and not self.runner.is_running())
        if base_url is None and not self.runner.is_running():
            self.status.setText("Start the engine to run a benchmark against it.")
        elif not self.runner.is_running():
            self.status.setText(f"Ready to benchmark {base_url}.")

    # ---- a run -----------------------------------------------------------------------------------------
    def start_run(self) -> None:
        if self.base_url is None or self.runner.is_running():
            return
        rate = self.rate.value() or math.inf
        output_len = self.output_len.value()
        try:
            load = ServeLoad(self.base_url, model=self.model, endpoint=self.endpoint_kind.currentText(),
                             request_rate=rate, max_concurrency=self.concurrency.value() or None,
                             api_key=self.api_key)
        except ValueError as exc:
            self.status.setText(f"Cannot run: {exc}")
            return
        build = self._prompt_builder(load, self.num_requests.value(), output_len)
        self._config = {"endpoint": load.endpoint, "request_rate": "inf" if math.isinf(rate) else rate,
                        "max_concurrency": load.max_concurrency, "num_prompts": self.num_requests.value(),
                        "prompt_mean": self.prompt_mean.value(), "output_len": output_len,
                        "long_prompt_fraction": self.long_percent.value() / 100, "base_url": self.base_url}
        self._outcomes, self._done_at = [], []
        self._started = time.monotonic()
        self.throughput_plot.clear_data()
        self.latency_plot.clear_data()
        self.run_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.progress.setRange(0, self.num_requests.value())
        self.progress.setValue(0)
        self.progress.setVisible(True)
        self.status.setText(f"Preparing {self.num_requests.value()} prompts with the served model's tokenizer …")
        self.runner.start(load, build)

    def _prompt_builder(self, load: ServeLoad, num_requests: int, output_len: int):
        """What the worker thread runs first: prompts to token counts, counted by the server (network work)."""
        endpoint, seed = load.endpoint, int(time.time()) % 100000
        prompt_mean, long_fraction = self.prompt_mean.value(), self.long_percent.value() / 100
        base_url, model, api_key = self.base_url, self.model, self.api_key

        def build(progress):
            tokenizer = ServedTokenizer(base_url, model, api_key)
            try:
                return served_requests(tokenizer, num_requests, endpoint, seed, prompt_mean,
                                       long_fraction=long_fraction, long_range=(1024, 2048),
                                       fixed_output_len=output_len, on_progress=progress)
            finally:
                tokenizer.close()
        return build

    def _on_preparing(self, done: int, total: int) -> None:
        self.progress.setFormat("prompts %v of %m")
        self.progress.setValue(done)
        if done == total:
            self.progress.setFormat("%v of %m requests done")
            self.progress.setValue(0)
            self.status.setText(f"Running {total} requests against {self.base_url} …")

    def _on_outcome(self, outcome: RequestOutcome) -> None:
        now = time.monotonic()
        self._outcomes.append(outcome)
        self._done_at.append(now)  # when the GUI heard of it, for the live windowed rates
        recent = [o for o, t in zip(self._outcomes, self._done_at) if now - t <= RATE_WINDOW_S]
        window = min(RATE_WINDOW_S, max(now - self._started, 1e-3))
        self.throughput_plot.append(now, (len(recent) / window, sum(o.output_tokens for o in recent) / window / 10))
        ok = [o for o in self._outcomes if o.ok]
        if ok:
            ttft = np.percentile([o.ttft * 1e3 for o in ok], (50, 99))
            itls = [x for o in ok for x in o.itls]
            itl = np.percentile(np.asarray(itls) * 1e3, (50, 99)) if itls else (0.0, 0.0)
            self.latency_plot.append(now, (ttft[0], ttft[1], itl[0], itl[1]))
        errors = len(self._outcomes) - len(ok)
        self.progress.setValue(len(self._outcomes))
        self.status.setText(f"{len(self._outcomes)} of {self.progress.maximum()} finished" +
                            (f", {errors} failed: {failure_words(self._first_error())}" if errors else "") + " …")

    def _first_error(self) -> str:
        return next((o.error or "no text came back" for o in self._outcomes if not o.ok), "")

    def _on_finished(self, result: BenchmarkResult) -> None:
        s = result.summary
        label = self.label.text().strip() or time.strftime("%H:%M:%S")
        self.store.save(label, self._config, s.to_dict(), result.curves)
        how = "Stopped early" if result.stopped_early else "Done"
        asked = self._config.get("num_prompts", s.completed + s.errors)
        failed = (f" {s.errors} failed: {failure_words(s.first_errors[0])}" if s.errors and s.first_errors else
                  f" {s.errors} failed." if s.errors else "")
        self.status.setText(f"{how}: {s.completed} of {asked} requests completed in {s.duration_s:.1f} s, "
                            f"{s.request_throughput:.2f} req/s, {s.output_throughput:.1f} output tok/s.{failed}")
        self._end_run()
        self.refresh_runs()

    def _on_failed(self, message: str) -> None:
        self.status.setText(f"Benchmark failed: {message}")
        self._end_run()

    def _end_run(self) -> None:
        self.stop_button.setEnabled(False)  # Run comes back with the runner's `idle`, once its thread has ended
        self.progress.setVisible(False)

    # ---- past runs -------------------------------------------------------------------------------------
    def refresh_runs(self) -> None:
        self._runs = self.store.runs()
        self.table.setRowCount(len(self._runs))
        for row, run in enumerate(self._runs):
            for col, text in enumerate(_row(run)):
                self.table.setItem(row, col, QTableWidgetItem(text))
        self.table.resizeColumnsToContents()

    def selected_runs(self) -> list[StoredRun]:
        rows = sorted({index.row() for index in self.table.selectedIndexes()})
        return [self._runs[r] for r in rows][:2]

    def update_overlay(self) -> None:
        self.overlay.clear()
        for run, color in zip(self.selected_runs(), OVERLAY_COLORS):
            curves = self.store.curves(run.id)
            x = curves["percentiles"]
            if curves["itl_ms"]:
                self.overlay.plot(x, curves["itl_ms"], name=f"#{run.id} {run.label} ITL", pen=pg.mkPen(color, width=2))
            if curves["ttft_ms"]:
                self.overlay.plot(x, curves["ttft_ms"], name=f"#{run.id} {run.label} TTFT",
                                  pen=pg.mkPen(color, width=2, style=Qt.PenStyle.DashLine))


def _row(run: StoredRun) -> list[str]:
    s, c = run.summary, run.config
    return [run.label, f"{s['output_throughput']:.1f}", f"{s['request_throughput']:.2f}",
            format_ms(s['ttft']['p50_ms']), format_ms(s['ttft']['p99_ms']), format_ms(s['itl']['p50_ms']),
            format_ms(s['itl']['p99_ms']), str(s["errors"]), str(s["completed"]), str(c.get("request_rate")),
            str(c.get("max_concurrency") or "-"), str(run.id)]
