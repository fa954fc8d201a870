"""One PagedDesk per user and data folder: a second `pagedesk` asks the first to show its window, then exits.

The first instance listens on a local socket (QLocalServer) named after the user and the data folder, so
a test or a second profile with its own PAGEDESK_DATA_DIR is a separate instance. A later start connects
first: when someone answers, it sends "show" and waits for "ok" — the first window comes to the front and
the newcomer never starts a rival that would take the first one's engine for a foreign program. Nobody
answering means no instance runs (a socket file left by a killed one is removed before listening).
"""
from __future__ import annotations

import getpass
import hashlib

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

from app.paths import data_dir

SHOW, OK = b"show\n", b"ok\n"


def instance_name() -> str:
    folder = hashlib.sha1(str(data_dir().resolve()).encode()).hexdigest()[:12]
    return f"pagedesk-{getpass.getuser()}-{folder}"


class SingleInstance(QObject):
    show_requested = Signal()  # another `pagedesk` was started: bring this window to the front

    def __init__(self, name: str | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name or instance_name()
        self.server: QLocalServer | None = None

    def hand_over(self, timeout_ms: int = 2000) -> bool:
        """True when a running instance answered and was asked to show its window (then this one should exit)."""
        socket = QLocalSocket()
        socket.connectToServer(self.name)
        if not socket.waitForConnected(timeout_ms):
            return False
        socket.write(SHOW)
        socket.waitForBytesWritten(timeout_ms)
        answered = socket.waitForReadyRead(timeout_ms) and bytes(socket.readAll().data()).startswith(OK)
        socket.disconnectFromServer()
        return answered

    def listen(self) -> bool:
        """Become the instance others hand over to; False (and no guard) if the socket cannot be made."""
        QLocalServer.removeServer(self.name)  # only reached when nobody answered: a dead instance's leftover
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        if not server.listen(self.name):
            return False
        server.newConnection.connect(self._on_connection)
        self.server = server
        return True

    def _on_connection(self) -> None:
        while self.server is not None and self.server.hasPendingConnections():
            socket = self.server.nextPendingConnection()
            socket.readyRead.connect(lambda s=socket: self._on_message(s))
            socket.disconnected.connect(socket.deleteLater)

    def _on_message(self, socket: QLocalSocket) -> None:
        if bytes(socket.readAll().data()).startswith(SHOW):
            socket.write(OK)
            socket.flush()
            self.show_requested.emit()
