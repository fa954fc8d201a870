"""The Doctor tab: `pagedesk-doctor`'s pass/warn/fail table with its remedies, and a Re-run button.

The doctor runs as a subprocess (`python -m engine.doctor --json`, a QProcess: the GUI thread never
waits, and CUDA/NCCL tests never run inside the GUI process); its JSON becomes table rows. It runs the
first time the tab is shown and again on Re-run. Reads only engine.doctor.report (torch-free).
"""
from __future__ import annotations

import sys

from PySide6.QtCore import QProcess, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QPushButton, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from app.units import plural
from engine.doctor.report import Row, rows_from_json

DOCTOR_COMMAND = [sys.executable, "-m", "engine.doctor", "--json"]
STATUS_COLORS = {"pass": "#a3be8c", "warn": "#ebcb8b", "fail": "#bf616a"}


class DoctorPanel(QWidget):
    finished = Signal(list)  # list[Row] of the run that just ended ([] when the doctor could not run)

    def __init__(self, command: list[str] | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.command = command or DOCTOR_COMMAND
        self.rows: list[Row] = []
        self.process: QProcess | None = None
        self.rerun = QPushButton("Re-run", clicked=self.run)
        self.status = QLabel("Checks this machine's GPUs, drivers and kernels.")
        self.table = QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["Check", "Status", "Detail", "Remedy"])
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setWordWrap(True)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        for column, mode in enumerate([QHeaderView.ResizeMode.ResizeToContents] * 2 +
                                      [QHeaderView.ResizeMode.Stretch] * 2):
            header.setSectionResizeMode(column, mode)
        top = QHBoxLayout()
        top.addWidget(self.rerun)
        top.addWidget(self.status, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.table)

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().showEvent(event)
        if self.process is None and not self.rows:
            self.run()

    def run(self) -> None:
        if self.process is not None:
            return  # one run at a time
        self.rerun.setEnabled(False)
        self.status.setText("Running pagedesk-doctor… (GPU checks take up to a minute)")
        self.process = QProcess(self)
        self.process.finished.connect(self._on_finished)
        self.process.errorOccurred.connect(self._on_error)
        self.process.start(self.command[0], self.command[1:])

    def _on_error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart:
            self._done([], f"Could not start the doctor: {self.process.errorString()}")

    def _on_finished(self, exit_code: int, exit_status: QProcess.ExitStatus) -> None:
        out = bytes(self.process.readAllStandardOutput()).decode(errors="replace")
        err = bytes(self.process.readAllStandardError()).decode(errors="replace").strip()
        try:
            rows = rows_from_json(out)
        except (ValueError, KeyError, TypeError):
            tail = err.splitlines()[-1] if err else f"exit code {exit_code}"
            self._done([], f"The doctor stopped without a report: {tail}")
            return
        counts = {s: sum(r.status == s for r in rows) for s in STATUS_COLORS}
        self._done(rows, f"{counts['pass']} passed, {plural(counts['warn'], 'warning')}, {counts['fail']} failed")

    def _done(self, rows: list[Row], message: str) -> None:
        self.process.deleteLater()
        self.process = None
        self.rows = rows
        self._fill(rows)
        self.status.setText(message)
        self.rerun.setEnabled(True)
        self.finished.emit(rows)

    def _fill(self, rows: list[Row]) -> None:
        self.table.setRowCount(len(rows))
        for i, row in enumerate(rows):
            for column, text in enumerate([row.check, row.status.upper(), row.detail, row.remedy]):
                item = QTableWidgetItem(text)
                if column == 1:
                    item.setBackground(QColor(STATUS_COLORS[row.status]))
                self.table.setItem(i, column, item)
        self.table.resizeRowsToContents()

