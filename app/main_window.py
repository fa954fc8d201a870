"""PagedDesk's main window: Engine (model, settings, capacity, log), Models, Chat, Monitor and Endpoint tabs.

Wires the parts together and owns their lifetimes: the `EngineSupervisor` (Start/Stop/Restart in
the toolbar; state, model and live URL in the status chip and the title), the `StatsClient` (started
when the engine is READY, feeding the Monitor), the `NvmlThread` (GPU readings), the chat panel and
endpoint panel (told the endpoint when it changes), the tray icon. Settings persist through
QSettings. Stop closes the app's own streams before signalling the engine, so its graceful shutdown
has nothing to cancel. A failure is shown only until something changes: a new model, an edited setting or
a new Start clears the red banner, the port banner and CRASHED. Closing the window stops the engine's whole process group, so nothing is
left holding VRAM — unless "keep serving when the window closes" is on and a tray icon can bring
the window back.
"""
from __future__ import annotations

import time

from PySide6.QtCore import QCoreApplication, QSettings, Qt, QTimer
from PySide6.QtGui import QAction, QCloseEvent, QFontDatabase, QIcon
from PySide6.QtWidgets import (QApplication, QGroupBox, QHBoxLayout, QLabel, QMainWindow, QPlainTextEdit,
                               QScrollArea, QSplitter, QTabWidget, QVBoxLayout, QWidget)

from app.bench_store import BenchStore
from app.benchmark_panel import BenchmarkPanel
from app.capacity import cannot_plan, capacity_line
from app.chat_panel import ChatPanel
from app.autostart import autostart_enabled, set_autostart
from app.chat_store import ChatStore
from app.doctor_panel import DoctorPanel
from app.endpoint_panel import EndpointPanel
from app.engine_record import EngineRecord, find_leftover
from app.engine_state import EngineState
from app.leftover_banner import LeftoverBanner
from app.loaded_models import LoadedModelsPanel
from app.model_info import ModelInfo
from app.model_library import ModelLibrary
from app.model_picker import ModelPicker
from app.monitor_panel import MonitorPanel
from app.nvml_sampler import NvmlThread
from app.paths import ICON_PATH, data_dir
from app.port_banner import PortBanner
from app.served_set import load_served_set, save_served_set
from app.served_set_panel import ServedSetPanel
from app.settings import gui_flags, load_values, save_values
from app.settings_form import SettingsForm
from app.stats_client import StatsClient
from app.status_chip import StatusChip, status_text
from app.supervisor import CRASHED, FAILED, READY, STARTING, STOPPED, STOPPING, EngineSupervisor, connect_host
from app.theme import is_dark
from app.tray import Tray
from engine.config.model_discovery import default_model_name
from widgets.gpu_panel import GpuReading

KEEP_SERVING_KEY = "app/keep_serving"
DRAIN_S = 1.0  # longest wait for the app's streams to close before the engine gets SIGTERM
LOG_LINES = 5000
STATS_HZ = 4.0
PLAN_USED_STEP = 256 << 20  # re-plan when what other programs hold on a card moves by this much


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
        self.gpu_memory: list[int] = []  # each card's total, from NVML
        self.gpu_used: list[int] = []  # what other programs held on each card while our engine was stopped
        self.stats_hz = STATS_HZ
        self._closed = False
        self.keep_serving_for_session = False
        self.serving_together = False  # the last start ran the router (models served together)
        self.model_rows: list = []  # each served model's state (app.loaded_models.ModelRow), for the chip
        self.progress_text = ""  # what STARTING waits for
        if num_gpus is None:
            from app.nvml_sampler import count_nvidia_gpus
            num_gpus = count_nvidia_gpus()
        self.num_gpus = num_gpus

        self.model_picker = ModelPicker()
        self.settings_form = SettingsForm(gui_flags())
        self.settings_form.set_hardware(num_gpus)
        self.settings_form.set_values(load_values(self.qsettings, num_gpus))
        self.capacity = QLabel(wordWrap=True, textInteractionFlags=Qt.TextInteractionFlag.TextSelectableByMouse)
        self.log_view = QPlainTextEdit(readOnly=True, maximumBlockCount=LOG_LINES)
        self.log_view.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.log_view.setPlaceholderText("The engine's output appears here once it starts. No model yet? Pick one "
                                         "in the Models tab, or choose a folder or a hub repo id above.")
        self.crash_box = QLabel(wordWrap=True, visible=False,
                                textInteractionFlags=Qt.TextInteractionFlag.TextSelectableByMouse)
        self.crash_box.setStyleSheet("background: #3b2a2e; color: #f0d0d0; padding: 6px; font-family: monospace;"
                                     if is_dark() else
                                     "background: #fbe3e4; color: #6b1d24; padding: 6px; font-family: monospace;")
        self.chat = ChatPanel(self.store, self.qsettings)
        self.monitor = MonitorPanel()
        self.endpoint = EndpointPanel()
        self.bench_store = BenchStore(data_dir() / "benchmarks.sqlite3")
        self.benchmark = BenchmarkPanel(self.bench_store)
        self.library = ModelLibrary(self.qsettings)
        self.loaded_models = LoadedModelsPanel()  # what the endpoint serves: every model, load/unload
        self.loaded_models.models_listed.connect(self.chat.set_models)
        self.loaded_models.models_listed.connect(self.monitor.set_models)
        self.loaded_models.models_listed.connect(self._on_models_listed)
        self.served = load_served_set(self.qsettings)
        self.served_panel = ServedSetPanel(self.served)
        self.served_panel.set_num_gpus(num_gpus)
        self.loaded_models.add_settings(self.served_panel)
        self.state_label = StatusChip()
        self.port_banner = PortBanner()
        self.leftover_banner = LeftoverBanner()
        self.tabs = QTabWidget()
        self.tabs.addTab(self._engine_tab(), "Engine")
        self.tabs.addTab(self.loaded_models, "Loaded models")
        self.tabs.addTab(self.library, "Models")
        self.tabs.addTab(self.chat, "Chat")
        self.tabs.addTab(self.monitor, "Monitor")
        self.tabs.addTab(self.endpoint, "Endpoint")
        self.tabs.addTab(self.benchmark, "Benchmark")
        self.tabs.addTab(DoctorPanel(), "Doctor")  # runs pagedesk-doctor when first shown
        central = QWidget()
        central_layout = QVBoxLayout(central)
        central_layout.setContentsMargins(0, 0, 0, 0)
        central_layout.addWidget(self.port_banner)
        central_layout.addWidget(self.leftover_banner)
        central_layout.addWidget(self.tabs, 1)
        self.setCentralWidget(central)
        self._drain_timer = QTimer(self, interval=25, timeout=self._drain_tick)
        self._drain_deadline = 0.0
        self._build_toolbar()
        self._build_menu()
        self.tray = Tray(self)
        self.statusBar().addPermanentWidget(self.state_label)
        self._connect()
        self.library.model_chosen.connect(self._choose_from_library)
        self.library.serve_alongside.connect(self._serve_alongside)
        self.library.models_found.connect(self.settings_form.set_draft_models)  # speculative drafts to pick
        self.model_picker.download_progress.connect(self.library.show_download)
        self.model_picker.download_ended.connect(self.library.end_download)
        self.model_picker.model_cleared.connect(lambda: self._on_model_changed(None))
        last_model = self.qsettings.value("model/path", "")
        if last_model:
            self.model_picker.set_model_path(str(last_model))
        self.library.refresh()
        self._on_state(STOPPED)
        self._offer_leftover()
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
        # Vertical scrolling only: the pane is as wide as its widest row, never clipped behind a scrollbar.
        scroll = self.settings_scroll = QScrollArea(widgetResizable=True)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(left)
        self.settings_form.advanced.setVisible(True)  # size for the widest state of the form
        scroll.setMinimumWidth(left.minimumSizeHint().width() + scroll.verticalScrollBar().sizeHint().width() + 4)
        self.settings_form.advanced.setVisible(False)
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
        splitter.setSizes([scroll.minimumWidth(), 800])
        splitter.setChildrenCollapsible(False)
        tab = QWidget()
        QHBoxLayout(tab).addWidget(splitter)
        return tab

    def _build_toolbar(self) -> None:
        bar = self.addToolBar("Engine")
        bar.setObjectName("engine-toolbar")
        self.start_action = QAction("▶ Start engine", self, triggered=self.start_engine)
        self.stop_action = QAction("■ Stop", self, triggered=self.stop_engine)
        self.restart_action = QAction("⟳ Restart", self, triggered=self.restart_engine)
        for action in (self.start_action, self.stop_action, self.restart_action):
            bar.addAction(action)

    def _build_menu(self) -> None:
        menu = self.menuBar().addMenu("&PagedDesk")
        self.keep_serving_action = QAction("Keep serving when the window closes", self, checkable=True)
        self.keep_serving_action.setChecked(self.qsettings.value(KEEP_SERVING_KEY, False, type=bool))
        self.keep_serving_action.toggled.connect(lambda on: self.qsettings.setValue(KEEP_SERVING_KEY, on))
        self.autostart_action = QAction("Start serving at login", self, checkable=True)
        self.autostart_action.setChecked(autostart_enabled())
        self.autostart_action.toggled.connect(set_autostart)
        self.quit_action = QAction("Quit (stops the engine)", self, triggered=self.quit_app)
        for action in (self.keep_serving_action, self.autostart_action, self.quit_action):
            menu.addAction(action)

    def _connect(self) -> None:
        sup = self.supervisor
        sup.state_changed.connect(self._on_state)
        sup.state_changed.connect(self._on_new_run)
        sup.log.connect(self._append_log)
        sup.log.connect(self.loaded_models.feed_log)
        sup.endpoint_up.connect(self._on_endpoint_up)
        sup.failed.connect(self._on_model_failed)
        sup.progress.connect(self._on_progress)
        self.loaded_models.log_line.connect(sup.log)  # loads and unloads asked here go into the logs too
        self.served_panel.changed.connect(self._on_served_set_changed)
        self.loaded_models.remove_requested.connect(
            lambda name: self.served_panel.remove_named(name, self._served_model_name()))
        self.monitor.model_selected.connect(self._watch_model)
        sup.ready.connect(self._on_ready)
        sup.crashed.connect(self._on_crashed)
        sup.message.connect(self._on_message)
        sup.port_busy.connect(self.port_banner.show_busy)
        self.port_banner.use_port.connect(self._use_port)
        self.leftover_banner.take_over.connect(self.take_over_engine)
        self.leftover_banner.stop_it.connect(self.stop_leftover_engine)
        self.stats.state.connect(self._on_engine_state)
        self.nvml.readings.connect(self._on_gpu_readings)
        self.nvml.unavailable.connect(self.monitor.on_gpu_unavailable)
        self.settings_form.changed.connect(self._on_settings_changed)
        self.model_picker.model_changed.connect(self._on_model_changed)

    # ---- engine control ----------------------------------------------------------------------------------
    def start_engine(self) -> bool:
        self._clear_failure()  # every attempt starts clean: a refused one must not show the last crash
        info = self.model_picker.info
        if info is None:
            self._on_message("Choose a model folder first (Engine tab → Model).")
            return False
        problems = self.settings_form.problems()
        if problems:
            self._on_message("Not started: " + " ".join(problems))
            row = self.settings_form.focus_first_problem()
            if row is not None:
                self.tabs.setCurrentIndex(0)
                self.settings_scroll.ensureWidgetVisible(row)
            return False
        if self._offer_leftover():
            self._on_message("Not started: an engine from an earlier PagedDesk still runs; take it over or stop it.")
            return False
        values = self.settings_form.values()
        save_values(self.qsettings, values)
        together = self.served.router_argv(self._served_model_name(), self.num_gpus)
        self.serving_together = bool(together)  # what this start serves, whatever the panel says later
        return self.supervisor.start(str(info.path), values, [*self.extra_engine_args, *together])

    def _serve_alongside(self, path: str) -> None:
        self.served_panel.add(path)
        self.tabs.setCurrentWidget(self.loaded_models)

    def _on_served_set_changed(self, served) -> None:
        self.served = served
        save_served_set(self.qsettings, served)
        if self.supervisor.running:
            self._on_message("The served set changed: it applies at the next Start (Restart now to apply it).")

    def _watch_model(self, name: str) -> None:
        """The Monitor's selector picked `name`: its engine-state stream from now on."""
        if self.supervisor.state == READY and self.supervisor.base_url:
            self.stats.start(self.supervisor.base_url, self.settings_form.values().get("api_key"), self.stats_hz,
                             model=name)

    def _offer_leftover(self) -> bool:
        """Show the take-over banner when an engine an earlier app started still runs; True if one does."""
        if self.supervisor.running:
            return False
        record = find_leftover()
        if record is not None:
            self.leftover_banner.show_record(record)
        return record is not None

    def take_over_engine(self, record: EngineRecord) -> None:
        """Mind the leftover engine from now on: its model in the picker, READY once its /health answers."""
        info = self.model_picker.info
        if record.model and (info is None or str(info.path) != record.model):
            self.model_picker.set_model_path(record.model)
        self.supervisor.adopt(record, self.settings_form.values().get("api_key"))

    def stop_leftover_engine(self, record: EngineRecord) -> None:
        if self.supervisor.adopt(record):
            self.supervisor.stop()

    def stop_engine(self) -> None:
        """STOPPING at once; SIGTERM once the app's own streams have closed (at most DRAIN_S later), because
        uvicorn cancels streams still open at its shutdown with a traceback per stream."""
        self._close_streams()
        self.supervisor.begin_stop()
        self._drain_deadline = time.monotonic() + DRAIN_S
        self._drain_timer.start()

    def _drain_tick(self) -> None:
        drained = self.stats.is_idle() and not self.chat.client.busy()
        if drained or time.monotonic() > self._drain_deadline:
            self._drain_timer.stop()
            self.supervisor.stop()

    def restart_engine(self) -> None:
        if self.supervisor.running:
            self.stop_engine()
            self.supervisor.state_changed.connect(self._start_after_stop)
        else:
            self.start_engine()

    def _close_streams(self) -> None:
        """Close the app's own streams first: the engine's graceful shutdown then has none to cancel."""
        self.stats.stop()
        self.chat.client.stop()
        self.chat.set_endpoint(None)
        self.benchmark.runner.stop()

    def _choose_from_library(self, path: str) -> None:
        if self.model_picker.set_model_path(path):
            self.tabs.setCurrentIndex(0)

    def _clear_failure(self) -> None:
        """The last failure described the old model or settings (or the last attempt): show it no longer."""
        self.crash_box.setVisible(False)
        self.crash_box.clear()
        self.port_banner.hide()
        self.statusBar().clearMessage()
        if self.supervisor.restart_pending and not self.supervisor.running:
            self._append_log("[pagedesk] The automatic restart was cancelled: the model or settings changed.\n")
        self.supervisor.clear_failure()

    def _use_port(self, port: int) -> None:
        self.settings_form.set_values({"port": port})
        self.start_engine()

    def _start_after_stop(self, state: str) -> None:
        if state == STOPPED:
            self.supervisor.state_changed.disconnect(self._start_after_stop)
            self.start_engine()

    # ---- reactions --------------------------------------------------------------------------------------------
    def _update_actions(self) -> None:
        """Start and Restart need a model and settings without errors (each error is shown at its field)."""
        state, sup = self.supervisor.state, self.supervisor
        running = state in (READY, STARTING, STOPPING, FAILED)
        startable = self.model_picker.info is not None and not self.settings_form.problems()
        self.start_action.setEnabled(not running and not sup.running and startable)
        self.start_action.setToolTip("Fix the settings marked in red first" if self.model_picker.info is not None
                                     and not startable else "Start the engine with this model and these settings")
        self.stop_action.setEnabled(state != STOPPING and (running or sup.running or sup.restart_pending))
        self.restart_action.setEnabled(state != STOPPING and startable)

    def _on_state(self, state: str) -> None:
        self._update_actions()
        if state != READY:
            self.stats.stop()
            self.chat.set_endpoint(None)
            self.benchmark.set_endpoint(None)
            self.monitor.on_engine_stopped()
            self._update_endpoint()
        if state not in (READY, FAILED):  # FAILED: the router still lists every model's state and error
            self.loaded_models.set_endpoint(None)
        self._show_status()

    def _on_new_run(self, state: str) -> None:
        """A new run (Start, Restart, an automatic restart): its logs and model states start empty."""
        if state == STARTING:
            self.loaded_models.new_run()
            self.model_rows, self.progress_text = [], ""

    def _show_status(self) -> None:
        """Chip, title and tray all say the same: state, model, and the URL actually served (if any); with several
        models the chip counts the loaded ones and its tooltip gives each one's state."""
        state = self.supervisor.state
        serving = state in (READY, STARTING, STOPPING, FAILED)
        url = f"{self.supervisor.base_url}/v1" if serving and self.supervisor.base_url else ""
        info = self.model_picker.info
        model = self._served_model_name() if info is not None else ""
        model = model.rstrip("/").rsplit("/", 1)[-1] if model.startswith(("/", "~", ".")) else model
        label = f"{model} ({self.progress_text})" if state == STARTING and self.progress_text and model else model
        rows = self.model_rows if serving else []
        loaded = f"{sum(r.loaded for r in rows)} of {len(rows)} models loaded" if len(rows) > 1 else ""
        details = [f"{r.name}: {r.state}" + (f" — {r.error}" if r.error else "") for r in rows]
        if state == FAILED and self.supervisor.failure and len(rows) <= 1:
            details.append(self.supervisor.failure)
        self.state_label.set_status(state, " · ".join(p for p in (label, loaded) if p), url, details)
        self.setWindowTitle(" — ".join(p for p in ("PagedDesk", model, url) if p))
        self.tray.set_status(status_text(state, model, url), state, url)

    def _on_models_listed(self, rows) -> None:
        self.model_rows = list(rows)
        self._show_status()

    def _on_progress(self, text: str) -> None:
        self.progress_text = text
        self._show_status()

    def _on_endpoint_up(self, base_url: str) -> None:
        """Something answers at the URL (the router, before the main model is loaded): list every model's state."""
        self.loaded_models.set_endpoint(base_url, self.settings_form.values().get("api_key"))

    def _on_model_failed(self, message: str) -> None:
        model = self.supervisor.main_model or self._served_model_name()
        self.crash_box.setText(f"The endpoint is up, but {model} cannot serve:\n{message}")
        self.crash_box.setVisible(True)
        self._show_status()

    def _on_ready(self, base_url: str) -> None:
        api_key = self.settings_form.values().get("api_key")
        together = self.serving_together and self.supervisor.adopted is None
        self.stats.start(base_url, api_key, self.stats_hz, model=self._served_model_name() if together else None)
        self.chat.set_endpoint(base_url, api_key, self._served_model_name())
        self.loaded_models.set_endpoint(base_url, api_key)  # the readiness probe has loaded the chosen model
        self.benchmark.set_endpoint(base_url, api_key, self.settings_form.values().get("max_model_len"),
                                    self.supervisor.main_model or None)
        self._update_endpoint(running=True)
        self.crash_box.setVisible(False)  # the previous failure is over
        self._show_status()

    def _on_crashed(self, exit_code: int, last_lines: str) -> None:
        how = "was killed by a signal" if exit_code < 0 else f"exited with code {exit_code}"
        self.crash_box.setText(f"Engine {how}. Last log lines:\n{last_lines}")
        self.crash_box.setVisible(True)

    def _on_message(self, text: str) -> None:
        self.statusBar().showMessage(text, 15000)
        self._append_log(f"[pagedesk] {text}\n")

    def _append_log(self, text: str) -> None:
        """New lines follow at the bottom unless the reader scrolled up (trimming old lines must not stop that)."""
        bar = self.log_view.verticalScrollBar()
        following = bar.value() >= bar.maximum() - 2
        self.log_view.appendPlainText(text.rstrip("\n"))
        if following:
            bar.setValue(bar.maximum())

    def _on_engine_state(self, state: EngineState) -> None:
        self.monitor.on_state(state)  # whose engine the Monitor shows; the chat keeps the model picked there

    def _on_gpu_readings(self, readings: list[GpuReading]) -> None:
        totals = [r.memory_total for r in readings]
        # What other programs hold counts against the engine's budget too, but only while our engine holds
        # nothing (once it runs, its own memory is in the reading); re-plan when that moves by 256 MiB.
        used = [r.memory_used for r in readings] if self.supervisor.state in (STOPPED, CRASHED) else self.gpu_used
        moved = len(used) != len(self.gpu_used) or any(abs(a - b) >= PLAN_USED_STEP for a, b in zip(used,
                                                                                               self.gpu_used))
        if totals != self.gpu_memory or moved:  # first sample, a card changed, or the desktop took memory
            self.gpu_memory, self.gpu_used = totals, used
            self._update_capacity()
        self.monitor.on_gpu_readings(readings)

    def _on_model_changed(self, info: ModelInfo | None) -> None:
        """A new model, or None when the chosen path holds none (nothing may keep describing the old one)."""
        if info is not None:
            self.qsettings.setValue("model/path", str(info.path))
        self._clear_failure()
        self.settings_form.set_model(info)
        self._update_capacity()
        self._update_endpoint()
        self._on_state(self.supervisor.state)

    def _on_settings_changed(self) -> None:
        self._clear_failure()
        self._update_capacity()
        self._update_endpoint()
        self._update_actions()
        self._show_status()

    def _update_capacity(self) -> None:
        info = self.model_picker.info
        values = self.settings_form.values()
        refused = self.settings_form.field_problems().get("speculative_config")
        self.capacity.setText(cannot_plan(ValueError(" ".join(refused))) if refused and info else  # no phantom draft
                              capacity_line(info.config if info else None, values, self.gpu_memory,
                                            self.gpu_used or None))
        self.library.set_machine(values, self.gpu_memory)

    def _served_model_name(self) -> str:
        values = self.settings_form.values()
        info = self.model_picker.info
        return values.get("served_model_name") or (default_model_name(str(info.path)) if info else "model")

    def _update_endpoint(self, running: bool | None = None) -> None:
        values = self.settings_form.values()
        running = self.supervisor.state == READY if running is None else running
        base = (self.supervisor.base_url if running and self.supervisor.base_url else
                f"http://{connect_host(values.get('host') or '127.0.0.1')}:{values.get('port') or 8000}")
        self.endpoint.set_endpoint(base, values.get("api_key"), self._served_model_name(), running,
                                   values.get("max_model_len"))

    # ---- shutdown -----------------------------------------------------------------------------------------
    def open_first_view(self) -> None:
        """At launch: the Models tab while no model is chosen (that is the first thing to do), else the Engine tab."""
        if self.model_picker.info is None:
            self.tabs.setCurrentWidget(self.library)

    def shutdown(self) -> None:
        """Stop everything this window started; safe to call twice (closeEvent and aboutToQuit). While the engine
        stops (about a second) the chip and the status bar say so, and that its endpoint goes away."""
        if self._closed:
            return
        self._closed = True
        self._drain_timer.stop()
        save_values(self.qsettings, self.settings_form.values())
        self._close_streams()
        if self.supervisor.running:
            url = f"{self.supervisor.base_url}/v1"
            self.state_label.set_status(STOPPING, self.supervisor.main_model, url)
            self.statusBar().showMessage(f"Stopping the engine: {url} stops serving…")
            print(f"pagedesk: stopping the engine; {url} stops serving", flush=True)
            QCoreApplication.processEvents()  # paint that before the wait
        self.supervisor.shutdown()
        self.stats.wait_stopped()
        self.chat.client.wait_idle()
        self.nvml.stop()
        self.benchmark.runner.wait()
        self.store.close()
        self.bench_store.close()
        self.tray.hide()

    def quit_app(self) -> None:
        """Quit for real (menu, tray): stop the engine group, then end the application."""
        self.shutdown()
        app = QApplication.instance()
        if app is not None:
            app.quit()

    def keeps_serving_on_close(self) -> bool:
        return ((self.keep_serving_action.isChecked() or self.keep_serving_for_session) and self.tray.available()
                and self.supervisor.state in (READY, STARTING))

    def closeEvent(self, event: QCloseEvent) -> None:
        if self.keeps_serving_on_close():
            self.hide()  # the tray icon brings it back; Quit there stops the engine
            self.tray.notify("PagedDesk keeps serving", f"The engine still serves at {self.supervisor.base_url}/v1.")
            event.ignore()
            return
        self.shutdown()
        event.accept()
