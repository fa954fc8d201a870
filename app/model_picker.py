"""Model chooser: a local folder or GGUF file, a model from the hub cache, or a download by repo id.

Shows the chosen model's architecture, parameter count, context length and dtype (read from
config.json and safetensors headers, or a GGUF header, only). A repo id is first looked up on the Hub: a repo of
GGUF files offers them (quant, size, file) in a list and downloads only the one chosen. Downloads run a `DownloadWorker` on a daemon thread (a
download stuck on the network must not keep the application from quitting) with a progress bar and
a Cancel button; the GUI thread only receives the worker's signals.
"""
from __future__ import annotations

import threading

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QComboBox, QFileDialog, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QProgressBar,
                               QPushButton, QVBoxLayout, QWidget)

from app.hf_cache import CachedModel, DownloadWorker, RepoGguf, RepoListWorker, cached_models, hub_offline
from app.model_info import ModelInfo, read_model_info
from widgets.gpu_panel import format_bytes


class ModelPicker(QGroupBox):
    """Emits `model_changed(ModelInfo)` whenever a valid model folder is chosen."""

    model_changed = Signal(object)
    model_cleared = Signal()  # the path does not hold a readable model: plans for the old one no longer apply
    download_progress = Signal(str, str)  # repo id, progress text ("12% · 1.2 GiB / 9.8 GiB")
    download_ended = Signal(str, str)  # repo id, "" when it finished or why it did not

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Model", parent)
        self.info: ModelInfo | None = None
        self.path_edit = QLineEdit(placeholderText="Hugging Face model folder, or a .gguf file")
        self.path_edit.editingFinished.connect(lambda: self.set_model_path(self.path_edit.text()))
        browse = QPushButton("Browse…", clicked=self._browse)
        open_gguf = QPushButton("GGUF file…", clicked=self._browse_gguf)
        self.cache_combo = QComboBox()
        self.cache_combo.activated.connect(self._cache_chosen)
        rescan = QPushButton("Rescan cache", clicked=self.refresh_cache)
        self.repo_edit = QLineEdit(placeholderText="repo id, e.g. Qwen/Qwen2.5-0.5B-Instruct")
        self.repo_edit.textChanged.connect(self._forget_gguf_list)
        self.gguf_combo = QComboBox(visible=False, toolTip="This repo holds GGUF files: the one to download")
        self.download_button = QPushButton("Download", clicked=self.start_download)
        self.cancel_button = QPushButton("Cancel", clicked=self.cancel_download, enabled=False)
        self.progress = QProgressBar(visible=False)
        self.details = QLabel("No model chosen", wordWrap=True)
        layout = QVBoxLayout(self)
        for widgets in ((self.path_edit, browse, open_gguf), (QLabel("Hub cache:"), self.cache_combo, rescan),
                        (self.repo_edit, self.gguf_combo, self.download_button, self.cancel_button)):
            row = QHBoxLayout()
            for w in widgets:
                row.addWidget(w, 1 if isinstance(w, (QLineEdit, QComboBox)) else 0)
            layout.addLayout(row)
        layout.addWidget(self.progress)
        layout.addWidget(self.details)
        self._cached: list[CachedModel] = []
        self._worker: DownloadWorker | None = None
        self._lister: RepoListWorker | None = None
        self._gguf: tuple[str, list[RepoGguf]] | None = None  # (repo id, its GGUF files) once listed
        self.refresh_cache()

    def refresh_cache(self) -> None:
        self._cached = cached_models()
        self.cache_combo.clear()
        if not self._cached:
            self.cache_combo.addItem("(no models in the Hugging Face cache)")
        for m in self._cached:
            self.cache_combo.addItem(f"{m.repo_id}  ({format_bytes(m.size_on_disk)})")

    def _cache_chosen(self, row: int) -> None:
        if 0 <= row < len(self._cached):
            self.set_model_path(str(self._cached[row].snapshot))

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Choose a Hugging Face model folder", self.path_edit.text())
        if folder:
            self.set_model_path(folder)

    def _browse_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model file", self.path_edit.text(),
                                              "GGUF models (*.gguf)")
        if path:
            self.set_model_path(path)

    def set_model_path(self, folder: str) -> bool:
        folder = folder.strip()
        if not folder:
            return False
        self.path_edit.setText(folder)
        try:
            info = read_model_info(folder)
        except (OSError, ValueError, KeyError) as e:
            self.info = None
            self.details.setText(f"<span style='color:#bf616a'>{e}</span>")
            self.model_cleared.emit()
            return False
        self.info = info
        self.details.setText(info.describe())
        self.model_changed.emit(info)
        return True

    def start_download(self) -> None:
        """First press: ask the Hub whether the repo holds GGUF files (then offer them, one to choose); a press
        with a GGUF file chosen downloads it alone; a repo without GGUF files downloads whole."""
        repo_id = self.repo_edit.text().strip()
        if not repo_id or self._worker is not None or self._lister is not None:
            return
        if (self._gguf is None or self._gguf[0] != repo_id) and not hub_offline():  # offline: nothing to ask
            return self._list_gguf(repo_id)
        files = self._gguf[1] if self._gguf is not None else []
        chosen = files[self.gguf_combo.currentIndex()] if files and self.gguf_combo.currentIndex() >= 0 else None
        self._download(repo_id, chosen)

    def _list_gguf(self, repo_id: str) -> None:
        self._lister = RepoListWorker(repo_id)
        self._lister.listed.connect(self._on_listed)
        self._lister.failed.connect(lambda message: self._on_listed(repo_id, []))  # the download will say why
        self.download_button.setEnabled(False)
        self.details.setText(f"Looking at {repo_id} on the Hugging Face Hub…")
        threading.Thread(target=self._lister.run, name=f"list {repo_id}", daemon=True).start()

    def _on_listed(self, repo_id: str, files: list) -> None:
        self._lister = None
        self.download_button.setEnabled(True)
        if repo_id != self.repo_edit.text().strip():
            return
        self._gguf = (repo_id, files)
        if not files:
            return self._download(repo_id, None)
        self.gguf_combo.clear()
        self.gguf_combo.addItems([f.label() for f in files])
        self.gguf_combo.setVisible(True)
        self.details.setText(f"{repo_id} holds {len(files)} GGUF file{'s' if len(files) > 1 else ''}: choose the "
                             "quant to download, then press Download again.")

    def _forget_gguf_list(self) -> None:
        if self._gguf is not None and self._gguf[0] != self.repo_edit.text().strip():
            self._gguf = None
            self.gguf_combo.clear()
            self.gguf_combo.setVisible(False)

    def _download(self, repo_id: str, gguf: RepoGguf | None) -> None:
        self._worker = DownloadWorker(repo_id, gguf=gguf)
        self._worker.progress.connect(self._on_progress)
        self._worker.finished.connect(self._on_downloaded)
        self._worker.failed.connect(self._on_download_failed)
        self.progress.setRange(0, 0)
        self.progress.setVisible(True)
        self.download_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        what = f"{repo_id} ({gguf.file})" if gguf is not None else repo_id
        self.details.setText(f"Downloading {what}… (a cancelled download resumes where it stopped)")
        self.download_progress.emit(repo_id, "starting…")
        threading.Thread(target=self._worker.run, name=f"download {repo_id}", daemon=True).start()

    def cancel_download(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            self.details.setText("Cancelling at the next progress update…")

    def _on_progress(self, done: float, total: float, unit: str) -> None:
        if unit != "B" or total <= 0:
            return
        self.progress.setRange(0, 1000)
        self.progress.setValue(int(1000 * done / total))
        self.progress.setFormat(f"{format_bytes(done)} / {format_bytes(total)}")
        if self._worker is not None:
            self.download_progress.emit(self._worker.repo_id,
                                        f"{100 * done / total:.0f}% · {format_bytes(done)} / {format_bytes(total)}")

    def _finish_download(self, message: str = "") -> None:
        if self._worker is not None:
            self.download_ended.emit(self._worker.repo_id, message)
        self._worker = None
        self.progress.setVisible(False)
        self.download_button.setEnabled(True)
        self.cancel_button.setEnabled(False)

    def _on_downloaded(self, path: str) -> None:
        self._finish_download()
        self.refresh_cache()
        self.set_model_path(path)

    def _on_download_failed(self, message: str) -> None:
        self._finish_download(message)
        self.details.setText(f"<span style='color:#bf616a'>{message}</span>")
