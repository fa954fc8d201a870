"""Polls GET <base>/health with QNetworkAccessManager until it answers 200, without blocking the GUI.

Each tick sends one request (never more than one in flight) with a short transfer timeout; the first
200 emits `healthy` and stops polling. Everything is asynchronous on the GUI event loop.
"""
from __future__ import annotations

from PySide6.QtCore import QObject, QTimer, QUrl, Signal
from PySide6.QtNetwork import QNetworkAccessManager, QNetworkReply, QNetworkRequest


class HealthProbe(QObject):
    healthy = Signal()

    def __init__(self, interval_ms: int = 250, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._manager = QNetworkAccessManager(self)
        self._timer = QTimer(self, interval=interval_ms, timeout=self._poll)
        self._url = QUrl()
        self._reply: QNetworkReply | None = None

    def start(self, base_url: str) -> None:
        self._url = QUrl(base_url.rstrip("/") + "/health")
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()
        if self._reply is not None:
            reply, self._reply = self._reply, None
            reply.abort()
            reply.deleteLater()

    def is_polling(self) -> bool:
        return self._timer.isActive()

    def _poll(self) -> None:
        if self._reply is not None:
            return
        request = QNetworkRequest(self._url)
        request.setTransferTimeout(1000)
        self._reply = self._manager.get(request)
        self._reply.finished.connect(self._on_finished)

    def _on_finished(self) -> None:
        reply, self._reply = self._reply, None
        if reply is None:
            return
        status = reply.attribute(QNetworkRequest.Attribute.HttpStatusCodeAttribute)
        reply.deleteLater()
        if status == 200 and self._timer.isActive():
            self._timer.stop()
            self.healthy.emit()
