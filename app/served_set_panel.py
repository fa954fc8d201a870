"""Settings of the served set (app/served_set.py) in the Loaded models tab: models served alongside the
chosen one (add a folder, or "Serve alongside" in the Models tab; remove), the idle time after which a
model is unloaded, and one copy per card. Changes apply at the next Start, which the panel says."""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QFileDialog, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QListWidget,
                               QPushButton, QSpinBox, QVBoxLayout, QWidget)

from app.served_set import ServedSet


class ServedSetPanel(QGroupBox):
    changed = Signal(object)  # ServedSet

    def __init__(self, served: ServedSet, parent: QWidget | None = None) -> None:
        super().__init__("Served together (applies at the next Start)", parent)
        self.served = ServedSet(list(served.alongside), served.model_ttl_minutes, served.one_copy_per_card)
        self.alongside = QListWidget(maximumHeight=90)
        self.add_button = QPushButton("Add folder…", clicked=self._add_folder)
        self.remove_button = QPushButton("Remove", clicked=self._remove)
        self.ttl = QSpinBox(minimum=0, maximum=7 * 24 * 60, suffix=" min", specialValueText="never")
        self.ttl.setToolTip("--model-ttl: a model idle this long is unloaded; the next request for it loads it again")
        self.one_copy = QCheckBox("Keep one copy per card (data parallel)")
        self.one_copy.setToolTip("--data-parallel-size N: the chosen model runs once on each card and requests go "
                                 "to the copy with the least work (or the one that has the conversation cached)")
        self.note = QLabel(wordWrap=True)
        buttons = QHBoxLayout()
        buttons.addWidget(self.add_button)
        buttons.addWidget(self.remove_button)
        buttons.addStretch(1)
        form = QFormLayout()
        form.addRow("Unload a model idle for", self.ttl)
        form.addRow(self.one_copy)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("Also serve, beside the model chosen in the Engine tab:"))
        layout.addWidget(self.alongside)
        layout.addLayout(buttons)
        layout.addLayout(form)
        layout.addWidget(self.note)
        self.set_num_gpus(0)
        self._show()
        self.ttl.valueChanged.connect(self._edited)
        self.one_copy.toggled.connect(self._edited)

    def set_num_gpus(self, num_gpus: int) -> None:
        self.num_gpus = num_gpus
        self.one_copy.setVisible(num_gpus > 1)

    def add(self, folder: str) -> None:
        if folder and folder not in self.served.alongside:
            self.served.alongside.append(folder)
            self._show()
            self.changed.emit(self.served)

    def remove_named(self, name: str, primary_name: str) -> bool:
        """Stop serving the model the router calls `name` (one served alongside; the chosen one stays)."""
        folder = self.served.names(primary_name).get(name)
        if folder is None:
            return False
        self.served.alongside.remove(folder)
        self._show()
        self.changed.emit(self.served)
        return True

    def _add_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "A model folder to serve alongside")
        self.add(folder)

    def _remove(self) -> None:
        row = self.alongside.currentRow()
        if 0 <= row < len(self.served.alongside):
            del self.served.alongside[row]
            self._show()
            self.changed.emit(self.served)

    def _edited(self, *_args) -> None:
        self.served.model_ttl_minutes = self.ttl.value()
        self.served.one_copy_per_card = self.one_copy.isChecked()
        self._show_note()
        self.changed.emit(self.served)

    def _show(self) -> None:
        self.alongside.clear()
        self.alongside.addItems(self.served.alongside)
        for w, value in ((self.ttl, self.served.model_ttl_minutes), (self.one_copy, self.served.one_copy_per_card)):
            w.blockSignals(True)
            w.setValue(value) if isinstance(w, QSpinBox) else w.setChecked(value)
            w.blockSignals(False)
        self.remove_button.setEnabled(bool(self.served.alongside))
        self._show_note()

    def _show_note(self) -> None:
        if self.served.uses_router(self.num_gpus):
            self.note.setText("One endpoint serves them all: a model loads on its first request; see each one's "
                              "state and log above.")
        else:
            self.note.setText("Only the chosen model is served.")
