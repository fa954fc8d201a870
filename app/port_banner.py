"""A banner above the tabs for a configured port that another process really holds.

It names the holder when /proc can tell, and offers the next free port as a button: the user
decides to move the endpoint (external clients point at it), the app never does so silently.
"""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget


BANNER_STYLE = ("QFrame#{name} {{ background: #f6e3b4; color: #3b2f10; border-radius: 4px; }}"
                "QFrame#{name} QLabel {{ color: #3b2f10; }}")


class PortBanner(QFrame):
    use_port = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("port-banner")
        self.setStyleSheet(BANNER_STYLE.format(name="port-banner"))
        self.text = QLabel(wordWrap=True)
        self.use_button = QPushButton(clicked=self._use)
        self.dismiss = QPushButton("Dismiss", clicked=self.hide)
        row = QHBoxLayout(self)
        row.addWidget(self.text, 1)
        row.addWidget(self.use_button)
        row.addWidget(self.dismiss)
        self.suggestion = 0
        self.hide()

    def show_busy(self, host: str, port: int, owner: str, suggestion: int) -> None:
        who = f" by {owner}" if owner else " by another program"
        self.text.setText(f"<b>Port {port} on {host} is in use{who}.</b> External clients configured for :{port} "
                          "would reach that program, not PagedDesk. Stop it, or serve on another port.")
        self.suggestion = suggestion
        self.use_button.setText(f"Use port {suggestion}" if suggestion else "No free port nearby")
        self.use_button.setEnabled(bool(suggestion))
        self.show()

    def _use(self) -> None:
        if self.suggestion:
            self.hide()
            self.use_port.emit(self.suggestion)
