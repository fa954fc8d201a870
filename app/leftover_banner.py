"""A banner above the tabs for an engine that an earlier PagedDesk left running (app/engine_record.py).

It says which model it serves, where and under which pid, and offers "Take over" (this window minds it
from now on: chat, Monitor and Stop work on it) or "Stop it" (its process group is ended). Shown at
launch and when Start finds the port held by that engine, never when the port holder is someone else's.
"""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget

from app.engine_record import EngineRecord
from app.port_banner import BANNER_STYLE


class LeftoverBanner(QFrame):
    take_over = Signal(object)  # the EngineRecord
    stop_it = Signal(object)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("leftover-banner")
        self.setStyleSheet(BANNER_STYLE.format(name="leftover-banner"))
        self.text = QLabel(wordWrap=True)
        self.take_button = QPushButton("Take over", clicked=lambda: self._emit(self.take_over))
        self.stop_button = QPushButton("Stop it", clicked=lambda: self._emit(self.stop_it))
        row = QHBoxLayout(self)
        row.addWidget(self.text, 1)
        row.addWidget(self.take_button)
        row.addWidget(self.stop_button)
        self.record: EngineRecord | None = None
        self.hide()

    def show_record(self, record: EngineRecord) -> None:
        self.record = record
        model = record.model.rstrip("/").rsplit("/", 1)[-1] or record.model
        self.text.setText(f"<b>An engine started by an earlier PagedDesk is still running</b>: {model} at "
                          f"{record.base_url}/v1 (pid {record.pid}). Take it over to chat with it and stop it "
                          "from here, or stop it to free its memory and port.")
        self.show()

    def _emit(self, signal) -> None:
        record, self.record = self.record, None
        self.hide()
        if record is not None:
            signal.emit(record)
