"""The engine settings form, rendered from the flag declarations (never written out by hand).

Each GUI flag becomes one editor chosen by its type: a checkbox for booleans, a combo box for
choices, a spin box for numbers (an "auto" special value stands for None when the default is None),
a line edit for text (empty means None; the API key is masked). Flags are grouped by `Flag.group`
and carry their help text as the tooltip. `values()` / `set_values()` speak {flag name: value}.
"""
from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout, QGroupBox, QLineEdit, QSpinBox,
                               QVBoxLayout, QWidget)

from engine.config import Flag

GROUP_TITLES = {"engine": "Engine", "cache": "KV cache", "scheduler": "Scheduler", "parallel": "Parallelism",
                "server": "Server", "model": "Model"}
INT_MAX = 2 ** 31 - 1
AUTO = "auto"


ACRONYMS = {"api": "API", "gpu": "GPU", "kv": "KV"}


def label_for(flag: Flag) -> str:
    words = [ACRONYMS.get(w, w) for w in flag.name.split("_")]
    text = " ".join(words)
    return text[0].upper() + text[1:]


class FlagEditor:
    """One flag's editor widget plus conversion between the widget and the flag's value."""

    def __init__(self, flag: Flag) -> None:
        self.flag = flag
        self.widget = self._make()
        self.widget.setToolTip(f"{flag.cli}: {flag.help}")
        self.widget.setObjectName(flag.name)

    def _make(self) -> QWidget:
        f = self.flag
        if f.type is bool:
            return QCheckBox()
        if f.choices is not None:
            combo = QComboBox()
            for choice in f.choices:
                combo.addItem(str(choice), choice)
            return combo
        if f.type is int:
            spin = QSpinBox()
            low = int(f.minimum if f.minimum is not None else 0)
            if f.default is None:
                low -= 1  # the lowest value reads "auto" and means None
                spin.setSpecialValueText(AUTO)
            spin.setRange(low, int(f.maximum) if f.maximum is not None else INT_MAX)
            return spin
        if f.type is float:
            spin = QDoubleSpinBox(decimals=2, singleStep=0.05)
            spin.setRange(f.minimum if f.minimum is not None else 0.0, f.maximum if f.maximum is not None else 1e9)
            return spin
        edit = QLineEdit(placeholderText=AUTO if f.default is None else "")
        if "key" in f.name:
            edit.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        return edit

    def value(self) -> Any:
        w, f = self.widget, self.flag
        if isinstance(w, QCheckBox):
            return w.isChecked()
        if isinstance(w, QComboBox):
            return w.currentData()
        if isinstance(w, QSpinBox):
            return None if (f.default is None and w.value() == w.minimum()) else w.value()
        if isinstance(w, QDoubleSpinBox):
            return round(w.value(), 4)
        return w.text().strip() or None

    def set_value(self, value: Any) -> None:
        w = self.widget
        if isinstance(w, QCheckBox):
            w.setChecked(bool(value))
        elif isinstance(w, QComboBox):
            w.setCurrentIndex(max(0, w.findData(value)))
        elif isinstance(w, QSpinBox):
            w.setValue(w.minimum() if value is None else int(value))
        elif isinstance(w, QDoubleSpinBox):
            w.setValue(float(value))
        else:
            w.setText("" if value is None else str(value))

    def connect_changed(self, slot) -> None:
        w = self.widget
        signal = {QCheckBox: "toggled", QComboBox: "currentIndexChanged", QSpinBox: "valueChanged",
                  QDoubleSpinBox: "valueChanged", QLineEdit: "textChanged"}[type(w)]
        getattr(w, signal).connect(lambda *_: slot())


class SettingsForm(QWidget):
    """Grouped editors for `flags`; emits `changed` on any edit."""

    changed = Signal()

    def __init__(self, flags: tuple[Flag, ...], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.editors = {f.name: FlagEditor(f) for f in flags}
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        forms: dict[str, QFormLayout] = {}
        for editor in self.editors.values():
            group = editor.flag.group
            if group not in forms:
                box = QGroupBox(GROUP_TITLES.get(group, group.capitalize()))
                forms[group] = QFormLayout(box)
                layout.addWidget(box)
            forms[group].addRow(label_for(editor.flag), editor.widget)
            editor.set_value(editor.flag.default)
            editor.connect_changed(self.changed.emit)
        layout.addStretch(1)

    def values(self) -> dict[str, Any]:
        return {name: e.value() for name, e in self.editors.items()}

    def set_values(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if name in self.editors:
                self.editors[name].set_value(value)
