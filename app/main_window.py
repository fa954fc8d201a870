"""PagedDesk's main window: Engine (model, settings, capacity, log), Chat, Monitor and Endpoint tabs.

Wires the parts together and owns their lifetimes: the `EngineSupervisor` (Start/Stop/Restart in
the toolbar, state in the status bar), the `StatsClient` (started when the engine is READY, feeding
the Monitor), the `NvmlThread` (GPU readings), the chat panel and endpoint panel (told the endpoint
when it changes). Settings persist through QSettings. Closing the window stops the engine's whole
process group, so nothing is left holding VRAM.
"""
from __future__ import annotations


from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QAction, QCloseEvent, QFontDatabase, QIcon
from PySide6.QtWidgets import (QGroupBox, QHBoxLayout, QLabel, QMainWindow, QPlainTextEdit, QScrollArea, QSplitter,
                               QTabWidget, QVBoxLayout, QWidget)

from app.bench_store import BenchStore
from app.benchmark_panel import BenchmarkPanel
from app.capacity import capacity_line
from app.chat_panel import ChatPanel
from app.chat_store import ChatStore
from app.endpoint_panel import EndpointPanel
from app.engine_state import EngineState
from app.model_info import ModelInfo
from app.model_picker import ModelPicker
from app.monitor_panel import MonitorPanel
from app.nvml_sampler import NvmlThread
from app.paths import ICON_PATH, data_dir
from app.settings import gui_flags, load_values, save_values
from app.settings_form import SettingsForm
from app.stats_client import StatsClient
from app.supervisor import CRASHED, READY, STARTING, STOPPED, EngineSupervisor, connect_host
from widgets.gpu_panel import GpuReading

STATE_COLORS = {READY: "#a3be8c", STARTING: "#ebcb8b", CRASHED: "#bf616a", STOPPED: "#808890"}
LOG_LINES = 5000
STATS_HZ = 4.0


class MainWindow(QMainWindow):
    def __init__(self, settings: QSettings | None = None, supervisor: EngineSupervisor | None = None,
                 extra_engine_args: list[str] | None = None, num_gpus: int | None = None,
                 sample_gpus: bool = True) -> None:
        super().__init__()
        self.setWindowTitle("PagedDesk")
        self.setWindowIcon(QIcon(str(ICON_PATH)))
        self.qsettings = settings or QSettings("PagedDesk", "PagedDesk")
        self.extra_engine_args = list(extra_engine_args or [])
        self.supervisor = supervisor or EngineSupervisor()
        self.supervisor.setParent(self)
        self.stats = StatsClient(self)
        self.nvml = NvmlThread(parent=self)
        self.store = ChatStore(data_dir() / "chats.sqlite3")
        self.gpu_memory: list[int] = []
        self.stats_hz = STATS_HZ
        self._closed = False
        if num_gpus is None:
            from app.nvml_sampler import count_nvidia_gpus
            num_gpus = count_nvidia_gpus()

        self.model_picker = ModelPicker()
        self.settings_form = SettingsForm(gui_flags())
        self.settings_form.set_values(load_values(self.qsettings, num_gpus))
        self.capacity = QLabel(wordWrap=True, textInteractionFlags=Qt.TextInteractionFlag.TextSelectableByMouse)
        self.log_view = QPlainTextEdit(readOnly=True, maximumBlockCount=LOG_LINES)
        self.log_view.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.crash_box = QLabel(wordWrap=True, visible=False,
                                textInteractionFlags=Qt.TextInteractionFlag.TextSelectableByMouse)
        self.crash_box.setStyleSheet("background: #3b2a2e; color: #f0d0d0; padding: 6px; font-family: monospace;")
        self.chat = ChatPanel(self.store)
        self.monitor = MonitorPanel()
        self.endpoint = EndpointPanel()
        self.bench_store = BenchStore(data_dir() / "benchmarks.sqlite3")
        self.benchmark = BenchmarkPanel(self.bench_store)
        self.state_label = QLabel()
        self.tabs = QTabWidget()
        self.tabs.addTab(self._engine_tab(), "Engine")
        self.tabs.addTab(self.chat, "Chat")
        self.tabs.addTab(self.monitor, "Monitor")
        self.tabs.addTab(self.endpoint, "Endpoint")
        self.tabs.addTab(self.benchmark, "Benchmark")
        self.setCentralWidget(self.tabs)
        self._build_toolbar()
        self.statusBar().addPermanentWidget(self.state_label)
        self._connect()
        last_model = self.qsettings.value("model/path", "")
        if last_model:
            self.model_picker.set_model_path(str(last_model))
        self._on_state(STOPPED)
        self._update_capacity()
        self._update_endpoint()
        if sample_gpus:
            self.nvml.start()
        self.resize(1280, 860)

    # ---- layout ---------------------------------------------------------------------------------------
    def _engine_tab(self) -> QWidget:
        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.addWidget(self.model_picker)
        left_layout.addWidget(self.settings_form)
        scroll = QScrollArea(widgetResizable=True)
        scroll.setWidget(left)
        capacity_box = QGroupBox("Capacity planner")
        QVBoxLayout(capacity_box).addWidget(self.capacity)
        log_box = QGroupBox("Engine log")
        log_layout = QVBoxLayout(log_box)
        log_layout.addWidget(self.crash_box)
        log_layout.addWidget(self.log_view, 1)
        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.addWidget(capacity_box)
        right_layout.addWidget(log_box, 1)
        splitter = QSplitter()
        splitter.addWidget(scroll)
        splitter.addWidget(right)
        splitter.setSizes([480, 800])
        tab = QWidget()
        QHBoxLayout(tab).addWidget(splitter)
        return tab

    def _build_toolbar(self) -> None:
        bar = self.addToolBar("Engine")
        bar.setObjectName("engine-toolbar")
        self.start_action = QAction("▶ Start engine", self, triggered=self.start_engine)
        self.stop_action = QAction("■ Stop", self, triggered=self.supervisor.stop)
        self.restart_action = QAction("⟳ Restart", self, triggered=self.restart_engine)
        for action in (self.start_action, self.stop_action, self.restart_action):
            bar.addAction(action)

    def _connect(self) -> None:
        sup = self.supervisor
        sup.state_changed.connect(self._on_state)
        sup.log.connect(self._append_log)
        sup.ready.connect(self._on_ready)
        sup.crashed.connect(self._on_crashed)
        sup.message.connect(self._on_message)
        self.stats.state.connect(self._on_engine_state)
        self.nvml.readings.connect(self._on_gpu_readings)
        self.nvml.unavailable.connect(self.monitor.on_gpu_unavailable)
        self.settings_form.changed.connect(self._on_settings_changed)
        self.model_picker.model_changed.connect(self._on_model_changed)

    # ---- engine control ----------------------------------------------------------------------------------
    def start_engine(self) -> bool:
        info = self.model_picker.info
        if info is None:
            self._on_message("Choose a model folder first (Engine tab → Model).")
            return False
        values = self.settings_form.values()
        save_values(self.qsettings, values)
        self.crash_box.setVisible(False)
        return self.supervisor.start(str(info.path), values, self.extra_engine_args)

    def restart_engine(self) -> None:
        if self.supervisor.process is not None:
            self.supervisor.stop()
            self.supervisor.state_changed.connect(self._start_after_stop)
        else:
            self.start_engine()

    def _start_after_stop(self, state: str) -> None:
        if state == STOPPED:
            self.supervisor.state_changed.disconnect(self._start_after_stop)
            self.start_engine()

    # ---- reactions --------------------------------------------------------------------------------------------
    def _on_state(self, state: str) -> None:
        color = STATE_COLORS.get(state, "#808890")
        self.state_label.setText(f"<b style='color:{color}'>● {state}</b>")
        running = state in (READY, STARTING)
        self.start_action.setEnabled(not running)
        sup = self.supervisor
        self.stop_action.setEnabled(running or sup.process is not None or sup.restart_pending)
        if state != READY:
            self.stats.stop()
            self.chat.set_endpoint(None)
            self.benchmark.set_endpoint(None)
            self.monitor.on_engine_stopped()
            self._update_endpoint()

    def _on_ready(self, base_url: str) -> None:
        api_key = self.settings_form.values().get("api_key")
        self.stats.start(base_url, api_key, self.stats_hz)
        self.chat.set_endpoint(base_url, api_key, self._served_model_name())
        self.benchmark.set_endpoint(base_url, api_key, self.settings_form.values().get("max_model_len"))
        self._update_endpoint(running=True)
        self.statusBar().showMessage(f"Engine ready at {base_url}", 5000)

    def _on_crashed(self, exit_code: int, last_lines: str) -> None:
        how = "was killed by a signal" if exit_code < 0 else f"exited with code {exit_code}"
        self.crash_box.setText(f"Engine {how}. Last log lines:\n{last_lines}")
        self.crash_box.setVisible(True)

    def _on_message(self, text: str) -> None:
        self.statusBar().showMessage(text, 15000)
        self._append_log(f"[pagedesk] {text}\n")

    def _append_log(self, text: str) -> None:
        self.log_view.appendPlainText(text.rstrip("\n"))

    def _on_engine_state(self, state: EngineState) -> None:
        self.monitor.on_state(state)
        if state.model and state.model != self.chat.model:
            self.chat.set_endpoint(self.chat.base_url, self.chat.api_key, state.model)

    def _on_gpu_readings(self, readings: list[GpuReading]) -> None:
        totals = [r.memory_total for r in readings]
        if totals != self.gpu_memory:  # first sample (or a card changed): re-plan with real card sizes
            self.gpu_memory = totals
            self._update_capacity()
        self.monitor.on_gpu_readings(readings)

    def _on_model_changed(self, info: ModelInfo) -> None:
        self.qsettings.setValue("model/path", str(info.path))
        self._update_capacity()
        self._update_endpoint()

    def _on_settings_changed(self) -> None:
        self._update_capacity()
        self._update_endpoint()

    def _update_capacity(self) -> None:
        info = self.model_picker.info
        self.capacity.setText(capacity_line(info.config if info else None, self.settings_form.values(),
                                            self.gpu_memory))

    def _served_model_name(self) -> str:
        values = self.settings_form.values()
        info = self.model_picker.info
        return values.get("served_model_name") or (str(info.path) if info else "model")

    def _update_endpoint(self, running: bool | None = None) -> None:
        values = self.settings_form.values()
        running = self.supervisor.state == READY if running is None else running
        base = (self.supervisor.base_url if running and self.supervisor.base_url else
                f"http://{connect_host(values.get('host') or '127.0.0.1')}:{values.get('port') or 8000}")
        self.endpoint.set_endpoint(base, values.get("api_key"), self._served_model_name(), running)

    # ---- shutdown -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop everything this window started; safe to call twice (closeEvent and aboutToQuit)."""
        if self._closed:
            return
        self._closed = True
        save_values(self.qsettings, self.settings_form.values())
        self.stats.stop()  # close open streams first, so the engine's graceful shutdown has none to wait for
        self.chat.client.stop()
        self.benchmark.runner.stop()
        self.supervisor.shutdown()
        self.stats.wait_stopped()
        self.chat.client.wait_idle()
        self.nvml.stop()
        self.benchmark.runner.wait()
        self.store.close()
        self.bench_store.close()

    def closeEvent(self, event: QCloseEvent) -> None:
        self.shutdown()
        event.accept()
