"""The system-tray icon: the engine's state and URL, and Start / Stop / Open / Copy URL / Quit; while a model
serves, Sleep / Wake for it (sleep mode frees the GPU between sessions without a reload).

It calls the main window's own actions (one implementation each), so Quit from the tray runs the
same shutdown as the window: the engine's process group is stopped cleanly. Where the desktop has
no tray (or Qt runs offscreen) the icon is simply not shown and the window never hides into it.
"""
from __future__ import annotations

from PySide6.QtGui import QAction, QGuiApplication, QIcon
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from app.paths import ICON_PATH


class Tray(QSystemTrayIcon):
    def __init__(self, window) -> None:
        super().__init__(QIcon(str(ICON_PATH)), window)
        self.window = window
        self.url = ""
        self.menu = QMenu()
        self.status_action = QAction("PagedDesk", self.menu, enabled=False)
        self.copy_action = QAction("Copy endpoint URL", self.menu, triggered=self.copy_url, enabled=False)
        self.open_action = QAction("Open PagedDesk", self.menu, triggered=self.open_window)
        self.menu.addAction(self.status_action)
        self.menu.addAction(self.copy_action)
        self.menu.addSeparator()
        for action in (window.start_action, window.stop_action, self.open_action, window.quit_action):
            self.menu.addAction(action)
        self.sleep_actions = [window.sleep_action, window.wake_action]
        self.sleep_offered = False
        self.setContextMenu(self.menu)
        self.activated.connect(self._on_activated)
        if self.available():
            self.show()

    @staticmethod
    def available() -> bool:
        return QSystemTrayIcon.isSystemTrayAvailable()

    def set_status(self, text: str, state: str, url: str) -> None:
        self.url = url
        self.status_action.setText(text)
        self.copy_action.setEnabled(bool(url))
        self.setToolTip(f"PagedDesk: {text}")

    def offer_sleep(self, offered: bool) -> None:
        """Sleep and Wake in the menu (before Open) only while a model serves."""
        if offered == self.sleep_offered:
            return
        self.sleep_offered = offered
        if offered:
            self.menu.insertActions(self.open_action, self.sleep_actions)
        else:
            for action in self.sleep_actions:
                self.menu.removeAction(action)

    def copy_url(self) -> None:
        if self.url:
            QGuiApplication.clipboard().setText(self.url)

    def open_window(self) -> None:
        self.window.showNormal()
        self.window.raise_()
        self.window.activateWindow()

    def notify(self, title: str, text: str) -> None:
        if self.isVisible() and self.supportsMessages():
            self.showMessage(title, text, QSystemTrayIcon.MessageIcon.Information, 4000)

    def _on_activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason == QSystemTrayIcon.ActivationReason.Trigger:
            self.open_window()
