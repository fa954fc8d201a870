"""The "Loaded models" list: every model the endpoint serves, loaded or not, with load and unload buttons.

It reads the router's `GET /v1/models` (a one-model server lists its one model the same way, without the
router's fields) every few seconds and after each action, off the GUI thread: a plain thread does the HTTP
and hands rows back through a queued signal. `model_rows` turns the JSON into plain rows (tested without Qt
widgets). Load and unload are `POST /v1/models/NAME/load|unload` with the endpoint's key; a load can take as
long as the engine takes to start, so it runs on its own thread and the row says "loading" meanwhile.
`models_listed` tells the Chat tab's picker which models there are and which are loaded. A model that
failed says so with its engine's error in the row, and "Remove from served set" (`remove_requested`) drops it from
the models served alongside. Load is offered for a model that is not loaded, Unload for one that is; Sleep for a
loaded one and Wake for a sleeping one (sleep mode: the router's `POST /v1/models/NAME/sleep|wake_up`, or a one-engine
server's own `/sleep` and `/wake_up`, whose `/is_sleeping` the list reads); each action asked here is written to the
logs (`log_line`). Under the list, the selected model's own log
(app/model_logs.py sorts the router's output per model; it follows new lines, and a new run starts it empty) and,
when the main window adds it, the served-set settings (app/served_set_panel.py).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from urllib.parse import quote

import httpx
from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtGui import QColor, QFontDatabase
from PySide6.QtWidgets import (QHBoxLayout, QHeaderView, QLabel, QPlainTextEdit, QPushButton, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from app.model_logs import MAX_LINES, ROUTER, ModelLogs
from widgets.gpu_panel import format_bytes

COLUMNS = ("Model", "State", "Where", "Memory", "Context", "Quantization", "Error")
POLL_MS = 3000
LOAD_TIMEOUT_S = 900.0
DOING = {"load": "Loading", "unload": "Unloading", "sleep": "Putting to sleep", "wake_up": "Waking"}
DONE = {"load": "loaded", "unload": "unloaded", "sleep": "asleep", "wake_up": "awake"}
PENDING = {"load": "loading…", "unload": "unloading…", "sleep": "falling asleep…", "wake_up": "waking…"}


@dataclass(frozen=True)
class ModelRow:
    name: str
    state: str  # loaded | sleeping | loading | unloaded | dead | failed
    where: str  # "cuda:0 + cuda:1", "CPU", "" when not loaded
    memory_bytes: int
    context: int | None
    quantization: str
    error: str = ""
    managed: bool = True  # served by the router (load/unload work); False for a one-engine server
    loadable: bool = True  # loaded, or can be: its load has not failed and its config.json reads
    input_modalities: tuple[str, ...] | None = None  # ("text", "image") for a model that takes images; None: not said

    @property
    def takes_images(self) -> bool:
        return self.input_modalities is not None and "image" in self.input_modalities

    @property
    def loaded(self) -> bool:
        return self.state in ("loaded", "sleeping")  # a sleeping model's engine runs; a request wakes it

    @property
    def sleeping(self) -> bool:
        return self.state == "sleeping"

    @property
    def failed(self) -> bool:
        return self.state in ("failed", "dead")


def model_rows(payload: dict) -> list[ModelRow]:
    """Rows from a /v1/models answer; a single engine's list (no `loaded` field) counts as loaded."""
    rows = []
    for m in payload.get("data") or []:
        engines = m.get("engines") or []
        places = []
        for e in engines:
            devices = e.get("devices")
            if devices == "cpu" or devices is None:
                cores = e.get("cpu_cores")
                places.append("CPU" + (f" cores {','.join(map(str, cores))}" if cores else ""))
            else:
                places.append(" + ".join(f"cuda:{d}" for d in devices))
        state = m.get("state") or ("loaded" if m.get("loaded", True) else "unloaded")
        errors = [e.get("error") for e in engines if e.get("error")]
        rows.append(ModelRow(str(m.get("id")), state, " | ".join(places),
                             sum(int(e.get("memory_bytes") or 0) for e in engines),
                             m.get("max_model_len"), m.get("quantization") or "none",
                             errors[0] if errors else m.get("error") or m.get("config_error", ""), "loaded" in m,
                             state != "failed" and not m.get("config_error"),
                             tuple(m["input_modalities"]) if m.get("input_modalities") else None))
    return rows


def _single_engine_sleeps(root: str, headers: dict) -> bool:
    """A one-engine server's GET /is_sleeping; an older server without the route is awake."""
    try:
        answer = httpx.get(root + "/is_sleeping", headers=headers, timeout=10)
        return answer.status_code == 200 and answer.json().get("is_sleeping") is True
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


class _Relay(QObject):
    """Carries results from worker threads to the GUI thread (queued signal delivery). A child of the panel, so
    Qt deletes it on the GUI thread; a worker thread holds only this relay (never the panel, whose last Python
    reference must not drop there: a QObject deleted off its thread leaves its timers behind, and a later event
    loop crashes on them), and `send` drops a reply whose panel is gone."""

    listed = Signal(object)  # list[ModelRow]
    failed = Signal(str)
    acted = Signal(str, str, bool, str)  # name, action, ok, message

    def send(self, signal: str, *args) -> None:
        try:
            getattr(self, signal).emit(*args)
        except RuntimeError:  # the panel (and with it this relay) was deleted while the request ran
            pass


class LoadedModelsPanel(QWidget):
    models_listed = Signal(object)  # list[ModelRow]
    log_line = Signal(str)  # "[pagedesk] NAME: unloaded\n": what was asked here, for the logs
    remove_requested = Signal(str)  # a failed model's name: take it out of the served set

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.base_url: str | None = None
        self.api_key: str | None = None
        self.rows: list[ModelRow] = []
        self.pending: dict[str, str] = {}  # model -> action in flight
        self._relay = _Relay(self)
        self._relay.listed.connect(self._show)
        self._relay.failed.connect(self._on_failed)  # bound slots: dropped with the panel, though threads still reply
        self._relay.acted.connect(self._on_acted)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.load_button = QPushButton("Load", clicked=lambda: self.act("load"))
        self.unload_button = QPushButton("Unload", clicked=lambda: self.act("unload"))
        self.sleep_button = QPushButton("Sleep", clicked=lambda: self.act("sleep"),
                                        toolTip="Weights to CPU RAM, KV cache dropped: the GPU is free until Wake "
                                                "(or the next request)")
        self.wake_button = QPushButton("Wake", clicked=lambda: self.act("wake_up"))
        self.refresh_button = QPushButton("Refresh", clicked=self.refresh)
        self.remove_button = QPushButton("Remove from served set", visible=False,
                                         clicked=lambda: self.selected() and self.remove_requested.emit(self.selected()))
        self.status = QLabel(wordWrap=True)
        buttons = QHBoxLayout()
        for b in (self.load_button, self.unload_button, self.sleep_button, self.wake_button, self.refresh_button,
                  self.remove_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        self.logs = ModelLogs()
        self.log_title = QLabel("Select a model to see its log.")
        self.log_view = QPlainTextEdit(readOnly=True, maximumBlockCount=MAX_LINES)
        self.log_view.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.table.itemSelectionChanged.connect(self._show_log)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.itemSelectionChanged.connect(self._offer_removal)
        layout = self.layout_ = QVBoxLayout(self)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)
        layout.addWidget(self.status)
        layout.addWidget(self.log_title)
        layout.addWidget(self.log_view, 1)
        self.timer = QTimer(self, interval=POLL_MS, timeout=self.refresh)

    def add_settings(self, widget: QWidget) -> None:
        """The served-set settings, under the log."""
        self.layout_.addWidget(widget)

    def feed_log(self, text: str) -> None:
        """The engine's (or router's) output: sorted per model; the selected model's view follows."""
        touched = self.logs.feed(text)
        if self._log_key(self.selected()) in touched:
            self._show_log()

    def new_run(self) -> None:
        """The engine starts again: the previous run's logs and rows go."""
        self.logs.clear()
        self.log_view.clear()
        self._show([])

    def _log_key(self, name: str | None) -> str | None:
        """Whose lines a model's log is: its own under the router; everything a one-engine server prints."""
        single = len(self.rows) == 1 and not self.rows[0].managed
        return ROUTER if single and name is not None else name

    def _show_log(self) -> None:
        name = self.selected()
        if name is None:
            return
        lines = self.logs.lines(self._log_key(name))
        self.log_title.setText(f"Log of {name}" + ("" if lines else " (nothing yet: it has not been loaded)"))
        bar = self.log_view.verticalScrollBar()
        following = bar.value() >= bar.maximum() - 2 or self.log_title.property("model") != name
        self.log_title.setProperty("model", name)
        kept = bar.value()
        self.log_view.setPlainText("\n".join(lines))
        bar.setValue(bar.maximum() if following else kept)  # new lines follow, unless the reader scrolled up

    def set_endpoint(self, base_url: str | None, api_key: str | None = None) -> None:
        """base_url None: nothing is served; the list empties and polling stops."""
        self.base_url, self.api_key = base_url, api_key
        if base_url is None:
            self.timer.stop()
            self._show([])
            return
        self.timer.start()
        self.refresh()

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def refresh(self) -> None:
        if self.base_url is None:
            return
        root, headers, relay = self.base_url.rstrip("/"), self._headers(), self._relay

        def fetch() -> None:
            try:
                response = httpx.get(root + "/v1/models", headers=headers, timeout=10)
                response.raise_for_status()
                rows = model_rows(response.json())
                if len(rows) == 1 and not rows[0].managed and _single_engine_sleeps(root, headers):
                    rows = [replace(rows[0], state="sleeping")]
                relay.send("listed", rows)
            except (httpx.HTTPError, ValueError) as exc:
                relay.send("failed", f"Cannot list models: {exc}")

        threading.Thread(target=fetch, name="models-list", daemon=True).start()

    def selected(self) -> str | None:
        row = self.table.currentRow()
        return self.rows[row].name if 0 <= row < len(self.rows) else None

    def act(self, action: str, name: str | None = None) -> None:
        """POST load, unload, sleep or wake_up for `name` (default: the selected row)."""
        name = name or self.selected()
        if name is None or self.base_url is None or name in self.pending:
            return
        self.pending[name] = action
        self.status.setText(f"{DOING[action]} {name}…")
        row = next((r for r in self.rows if r.name == name), None)
        if row is not None and not row.managed:  # a one-engine server: its own sleep-mode routes
            url = f"{self.base_url.rstrip('/')}/{action}"
        else:
            url = f"{self.base_url.rstrip('/')}/v1/models/{quote(name, safe='/')}/{action}"
        headers, relay = self._headers(), self._relay

        def post() -> None:
            try:
                response = httpx.post(url, headers=headers, timeout=LOAD_TIMEOUT_S)
                ok = response.status_code == 200
                message = "" if ok else (response.json().get("error") or {}).get("message", response.text)
            except (httpx.HTTPError, ValueError) as exc:
                ok, message = False, str(exc)
            relay.send("acted", name, action, ok, message)

        threading.Thread(target=post, name=f"models-{action}", daemon=True).start()
        self._show(self.rows)

    def _offer_removal(self) -> None:
        """A failed model, selected: say why it failed and offer to stop serving it."""
        row = next((r for r in self.rows if r.name == self.selected()), None)
        failed = row is not None and row.managed and row.state == "failed"
        self.remove_button.setVisible(failed)
        if failed:
            self.status.setText(f"{row.name} failed: {row.error or 'no reason given'}. Fix its folder, or remove "
                                "it from the served set.")

    def _on_failed(self, text: str) -> None:
        self.status.setText(text)

    def _on_acted(self, name: str, action: str, ok: bool, message: str) -> None:
        self.pending.pop(name, None)
        text = f"{name}: {DONE[action]}" if ok else f"{name}: {action.replace('_', ' ')} failed: {message}"
        self.status.setText(text)
        self.log_line.emit(f"[pagedesk] {text}\n")
        self.refresh()

    def _show(self, rows: list[ModelRow]) -> None:
        selected = self.selected()
        self.rows = list(rows)
        self.table.setRowCount(len(self.rows))
        for i, r in enumerate(self.rows):
            state = PENDING.get(self.pending.get(r.name, ""), r.state)
            cells = (r.name, state, r.where, format_bytes(r.memory_bytes) if r.memory_bytes else "",
                     f"{r.context:,}" if r.context else "", r.quantization, r.error)
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if r.error:
                    item.setToolTip(r.error)
                self.table.setItem(i, j, item)
                if r.failed:
                    item.setForeground(QColor("#bf616a"))
            if r.name == (selected or self.rows[0].name):  # nothing chosen yet: the main model, listed first
                self.table.selectRow(i)
        self._update_buttons()
        self._offer_removal()
        self.models_listed.emit(self.rows)

    def _update_buttons(self) -> None:
        """Load for a model that is not loaded, Unload for one that is; neither while an action is under way, nor on
        a one-engine server (it has no load/unload routes). Sleep for a loaded model, Wake for a sleeping one (a
        one-engine server too)."""
        row = next((r for r in self.rows if r.name == self.selected()), None)
        acting = row is None or row.name in self.pending or row.state == "loading"
        busy = acting or not row.managed
        self.load_button.setEnabled(not busy and not row.loaded)
        self.unload_button.setEnabled(not busy and row.loaded)
        self.sleep_button.setEnabled(not acting and row.state == "loaded")
        self.wake_button.setEnabled(not acting and row.sleeping)


class ChatModelChoice(QWidget):
    """The Chat tab's model picker: the models that are loaded or can load (a failed one is left out), the
    others marked; `model_picked` on a change. The pick stays while it is listed (a new chat keeps it)."""

    model_picked = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        from PySide6.QtWidgets import QComboBox
        super().__init__(parent)
        self.rows: list[ModelRow] = []
        self.combo = QComboBox()
        self.combo.currentIndexChanged.connect(self._picked)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.combo, 1)

    def set_rows(self, rows: list[ModelRow]) -> None:
        current = self.current()
        self.rows = [r for r in rows if r.loadable]
        self.combo.blockSignals(True)
        self.combo.clear()
        for r in self.rows:
            note = "" if r.loaded else " (loading…)" if r.state == "loading" else " (loads on send)"
            self.combo.addItem(r.name + note, r.name)
        names = [r.name for r in self.rows]
        self.combo.setCurrentIndex(names.index(current) if current in names else 0 if names else -1)
        self.combo.blockSignals(False)
        if self.current() and self.current() != current:
            self.model_picked.emit(self.current())

    def current(self) -> str | None:
        data = self.combo.currentData()
        return str(data) if data is not None else None

    def _picked(self, _index: int) -> None:
        if self.current():
            self.model_picked.emit(self.current())

    def progress_line(self) -> str:
        """What the Chat tab says while a reply is coming: a model that is not loaded loads first."""
        row = next((r for r in self.rows if r.name == self.current()), None)
        if row is not None and not row.loaded:
            return f"Loading {row.name} on first use (the engine starts), then generating…"
        return "Generating…"
