"""The engine settings form, rendered from the flag declarations (never written out by hand).

Each GUI flag becomes one editor chosen by its type: a checkbox for booleans, a combo box for
choices, a spin box for numbers, a line edit for text (empty means None; the API key is masked). A
number whose default is None ("auto") gets an explicit "auto" checkbox beside its spin box, so it
can always go back to auto, and while auto it reads "auto (2,048)": the value the engine will use (the
model's context, the serving step budget, ...), never a meaningless minimum. Basic settings (context
length, KV cache precision, port, "use all GPUs") sit on top; everything else is under Advanced, grouped by `Flag.group`, with the help text as tooltip.
Spin boxes and combo boxes ignore the mouse wheel unless focused, so scrolling the form never edits
it. Out-of-range numbers stay as typed and are reported by `problems()` instead of snapping back
silently: each in red right under its own field (a speculative method the chosen model lacks, too) (a summary under the form names the fields, since some
sit under the closed Advanced section), and `focus_first_problem()` opens and focuses the first. `values()` / `set_values()` speak {flag name: value}.
"""
from __future__ import annotations

from typing import Any

from PySide6.QtCore import QEvent, QObject, Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel,
                               QLineEdit, QSpinBox, QVBoxLayout, QWidget)

from engine.config.flags import (DEFAULT_CPU_KV_CACHE_GIB, OFFLINE_MAX_NUM_BATCHED_TOKENS, SERVING_MAX_BATCH_PREFILL_TOKENS,
                           SERVING_MAX_NUM_BATCHED_TOKENS, Flag)

GROUP_TITLES = {"engine": "Engine", "cache": "KV cache", "scheduler": "Scheduler", "parallel": "Parallelism",
                "server": "Server", "model": "Model"}
BASIC = ("max_model_len", "kv_cache_dtype", "port")
BASIC_LABELS = {"max_model_len": "Context length (tokens)", "kv_cache_dtype": "KV cache precision",
                "port": "Port of the endpoint"}
INT_MAX = 2 ** 31 - 1
AUTO = "auto"
SHORT_CONTEXT = 128  # below this a chat's prompt plus reply hardly fits: say so
ACRONYMS = {"api": "API", "gpu": "GPU", "kv": "KV"}
LABELS = {"speculative_config": "Speculative decoding"}


def label_for(flag: Flag) -> str:
    if flag.name in LABELS:
        return LABELS[flag.name]
    words = [ACRONYMS.get(w, w) for w in flag.name.split("_")]
    text = " ".join(words)
    return text[0].upper() + text[1:]


class WheelGuard(QObject):
    """Drops wheel events on unfocused editors, so the form scrolls instead of changing values."""

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802 (Qt's name)
        if event.type() == QEvent.Type.Wheel and isinstance(watched, QWidget) and not watched.hasFocus():
            event.ignore()  # the scroll area behind it scrolls instead
            return True
        return False


class FlagEditor:
    """One flag's editor widget plus conversion between the widget and the flag's value."""

    def __init__(self, flag: Flag, wheel_guard: WheelGuard) -> None:
        self.flag = flag
        self.auto: QCheckBox | None = None
        self.input = self._make()
        for w in (self.input, self.auto):
            if w is not None:
                w.setToolTip(f"{flag.cli}: {flag.help}")
        self.input.setObjectName(flag.name)
        if isinstance(self.input, (QComboBox, QSpinBox, QDoubleSpinBox)):
            self.input.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
            self.input.installEventFilter(wheel_guard)
        self.widget = self._with_auto() if self.auto is not None else self.input
        self.error = QLabel(wordWrap=True, visible=False, objectName=f"{flag.name}-error")
        self.error.setStyleSheet("color: #bf616a;")
        self.row = QWidget()  # the field with its error line under it: one row of the form
        column = QVBoxLayout(self.row)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(2)
        column.addWidget(self.widget)
        column.addWidget(self.error)

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
            spin.setRange(int(f.minimum if f.minimum is not None else 0),
                          int(f.maximum) if f.maximum is not None else INT_MAX)
            return self._maybe_auto(spin)
        if f.type is float:
            # The range is wider than the flag's on purpose: a typed 0.01 stays visible and is reported by
            # `problems()` instead of snapping back to the previous value without a word.
            spin = QDoubleSpinBox(decimals=2, singleStep=0.05)
            spin.setRange(0.0, f.maximum if f.maximum is not None else 1e9)
            return self._maybe_auto(spin)
        edit = QLineEdit(placeholderText=AUTO if f.default is None else "")
        if "key" in f.name:  # empty is no key at all, which "auto" would not say
            edit.setPlaceholderText("none: the endpoint is open")
            edit.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        return edit

    def _maybe_auto(self, spin: QWidget) -> QWidget:
        if self.flag.default is None:  # None means "auto": an explicit checkbox, so auto is always reachable
            self.auto = QCheckBox(AUTO)
            self.auto.toggled.connect(self._on_auto_toggled)
        self.auto_value: float | None = None  # what auto resolves to, when a number
        self._auto_text = AUTO
        return spin

    def set_auto_hint(self, text: str, value: float | None = None) -> None:
        """What auto means here ("auto (2,048)"), shown in the greyed spin box while auto is on; `value` is where
        the box starts when auto is turned off."""
        spin = self.input
        self.auto_value = value
        spin.blockSignals(True)
        spin.setSpecialValueText(text if self.auto.isChecked() else "")
        if self.auto.isChecked():
            spin.setValue(spin.minimum())  # the special text shows only at the minimum
        spin.blockSignals(False)
        self._auto_text = text

    def _on_auto_toggled(self, on: bool) -> None:
        spin = self.input
        spin.setEnabled(not on)
        spin.blockSignals(True)
        spin.setSpecialValueText(self._auto_text if on else "")
        if on:
            spin.setValue(spin.minimum())
        elif spin.value() == spin.minimum() and self.auto_value is not None:
            spin.setValue(type(spin.value())(self.auto_value))  # start from what the engine was using
        spin.blockSignals(False)

    def _with_auto(self) -> QWidget:
        box = QWidget()
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.auto)
        row.addWidget(self.input, 1)
        return box

    def value(self) -> Any:
        w = self.input
        if self.auto is not None and self.auto.isChecked():
            return None
        if isinstance(w, QCheckBox):
            return w.isChecked()
        if isinstance(w, QComboBox):
            return w.currentData()
        if isinstance(w, QSpinBox):
            return w.value()
        if isinstance(w, QDoubleSpinBox):
            return round(w.value(), 4)
        return w.text().strip() or None

    def set_value(self, value: Any) -> None:
        w = self.input
        if self.auto is not None:
            self.auto.setChecked(value is None)
            if value is None:
                return
        if isinstance(w, QCheckBox):
            w.setChecked(bool(value))
        elif isinstance(w, QComboBox):
            w.setCurrentIndex(max(0, w.findData(value)))
        elif isinstance(w, QSpinBox):
            w.setValue(int(value))
        elif isinstance(w, QDoubleSpinBox):
            w.setValue(float(value))
        else:
            w.setText("" if value is None else str(value))

    def connect_changed(self, slot) -> None:
        w = self.input
        signal = {QCheckBox: "toggled", QComboBox: "currentIndexChanged", QSpinBox: "valueChanged",
                  QDoubleSpinBox: "valueChanged", QLineEdit: "textChanged"}[type(w)]
        getattr(w, signal).connect(lambda *_: slot())
        if self.auto is not None:
            self.auto.toggled.connect(lambda *_: slot())

    def problem(self) -> str | None:
        """Why the current value would be refused by the engine's range check, or None."""
        value, f = self.value(), self.flag
        if value is None or f.type not in (int, float):
            return None
        if (f.minimum is not None and value < f.minimum) or (f.maximum is not None and value > f.maximum):
            high = f"{f.maximum:g}" if f.maximum is not None else "∞"
            return f"{label_for(f)} must be between {f.minimum:g} and {high}; it is {value:g}."
        return None


def make_editor(flag: Flag, wheel_guard: WheelGuard):
    """The flag's editor: by type, except the speculative-decoding JSON, which has an editor of its own."""
    if flag.name == "speculative_config":
        from app.speculative_editor import SpeculativeEditor
        return SpeculativeEditor(flag, wheel_guard)
    return FlagEditor(flag, wheel_guard)


class SettingsForm(QWidget):
    """Basic settings on top, the rest under Advanced; emits `changed` on any edit."""

    changed = Signal()

    def __init__(self, flags: tuple[Flag, ...], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._wheel_guard = WheelGuard(self)
        self.editors = {f.name: make_editor(f, self._wheel_guard) for f in flags}
        self.model_context: int | None = None
        self.num_gpus = 0
        self._hidden: set[str] = set()  # rows that do not apply to this machine
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        basic_box = QGroupBox("Basic")
        self.basic_form = QFormLayout(basic_box)
        self.use_all_gpus = QCheckBox("Split the model over all GPUs (tensor parallel)")
        self.use_all_gpus.toggled.connect(self._on_use_all_gpus)
        layout.addWidget(basic_box)
        self.show_advanced = QCheckBox("Show advanced settings")
        layout.addWidget(self.show_advanced)
        self.advanced = QWidget()
        advanced_layout = QVBoxLayout(self.advanced)
        advanced_layout.setContentsMargins(0, 0, 0, 0)
        self.forms: dict[str, QFormLayout] = {}
        for editor in self.editors.values():
            name = editor.flag.name
            if name in BASIC:
                self.basic_form.addRow(BASIC_LABELS.get(name, label_for(editor.flag)), editor.row)
            else:
                group = editor.flag.group
                if group not in self.forms:
                    box = QGroupBox(GROUP_TITLES.get(group, group.capitalize()))
                    self.forms[group] = QFormLayout(box)
                    advanced_layout.addWidget(box)
                self.forms[group].addRow(label_for(editor.flag), editor.row)
            editor.set_value(editor.flag.default)
            editor.connect_changed(self.changed.emit)
        self.basic_form.addRow(self.use_all_gpus)
        self.basic_form.setRowVisible(self.use_all_gpus, False)
        layout.addWidget(self.advanced)
        self.problems_label = QLabel(wordWrap=True, visible=False, objectName="settings-problems")
        self.problems_label.setStyleSheet("color: #bf616a;")
        layout.addWidget(self.problems_label)
        layout.addStretch(1)
        self.advanced.setVisible(False)
        self.show_advanced.toggled.connect(self.advanced.setVisible)
        self.changed.connect(self._show_problems)
        if "tensor_parallel_size" in self.editors:
            self.editors["tensor_parallel_size"].connect_changed(self._sync_use_all_gpus)
        self._show_auto_hints()

    def values(self) -> dict[str, Any]:
        return {name: e.value() for name, e in self.editors.items()}

    def set_values(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if name in self.editors:
                self.editors[name].set_value(value)
        self._sync_use_all_gpus()

    def set_hardware(self, num_gpus: int) -> None:
        """Show the memory setting that applies here (GPU utilization, or the CPU engine's KV budget) and
        the "use all GPUs" switch when there are several cards."""
        self.num_gpus = num_gpus
        self._set_row_visible("gpu_memory_utilization", num_gpus > 0)
        self._set_row_visible("kv_cache_memory", num_gpus == 0)
        self.basic_form.setRowVisible(self.use_all_gpus, num_gpus > 1)
        self.use_all_gpus.setText(f"Split the model over all {num_gpus} GPUs (tensor parallel)")
        self._sync_use_all_gpus()
        self._show_auto_hints()

    def set_draft_models(self, models: list[tuple[str, str]]) -> None:
        """The library's models (name, folder), offered as speculative-decoding drafts."""
        editor = self.editors.get("speculative_config")
        if editor is not None:
            editor.set_draft_models(models)

    def set_model_context(self, max_position_embeddings: int | None) -> None:
        self.model_context = max_position_embeddings
        self._show_problems()

    def set_model(self, info) -> None:
        """The chosen model (app.model_info.ModelInfo, or None): its context, and what the speculative-decoding
        editor checks against it (an MTP head only where the checkpoint has one)."""
        editor = self.editors.get("speculative_config")
        if editor is not None:
            editor.set_model(info)
        self.set_model_context(info.context_length if info else None)

    def problems(self) -> list[str]:
        """What the engine would refuse, in words; empty when the settings can start."""
        return [p for field in self.field_problems().values() for p in field]

    def field_problems(self) -> dict[str, list[str]]:
        """{flag name: what is wrong with it}, basic fields first as on screen, for fields that apply here."""
        found: dict[str, list[str]] = {}
        for name, editor in sorted(self.editors.items(), key=lambda item: item[0] not in BASIC):
            problem = editor.problem()
            if problem and name not in self._hidden:
                found.setdefault(name, []).append(problem)
        max_len = self.values().get("max_model_len")
        if max_len is not None and self.model_context and max_len > self.model_context:
            found.setdefault("max_model_len", []).append(
                f"Context length {max_len:,} is longer than the model's {self.model_context:,} tokens.")
        return dict(sorted(found.items(), key=lambda item: item[0] not in BASIC))

    def focus_first_problem(self) -> QWidget | None:
        """Open Advanced if the first wrong field is there, focus that field and return it (None: nothing wrong)."""
        first = next(iter(self.field_problems()), None)
        if first is None:
            return None
        if first not in BASIC:
            self.show_advanced.setChecked(True)
        editor = self.editors[first]
        editor.input.setFocus(Qt.FocusReason.OtherFocusReason)
        return editor.row

    def warnings(self) -> list[str]:
        max_len = self.values().get("max_model_len")
        if max_len is not None and max_len < SHORT_CONTEXT:
            return [f"Context length {max_len} tokens leaves room for only a very short prompt and reply."]
        return []

    def auto_hints(self) -> dict[str, tuple[str, float | None]]:
        """{flag: (text, value)} of what each "auto" number resolves to on this machine with these settings, the
        way engine/config/flags.py resolves it for a server."""
        values, cuda = self.values(), self.num_gpus > 0
        context = values.get("max_model_len") or self.model_context
        chunked = values.get("enable_chunked_prefill", True)
        hints: dict[str, tuple[str, float | None]] = {
            "max_model_len": (f"auto ({self.model_context:,})", self.model_context) if self.model_context
            else ("auto (the model's context)", None),
            "kv_cache_memory": (f"auto ({DEFAULT_CPU_KV_CACHE_GIB:g} GiB)", DEFAULT_CPU_KV_CACHE_GIB) if not cuda
            else ("auto (from GPU memory utilization)", None)}
        if chunked:
            hints["max_num_batched_tokens"] = (f"auto ({SERVING_MAX_NUM_BATCHED_TOKENS:,})", SERVING_MAX_NUM_BATCHED_TOKENS)
            cap = SERVING_MAX_BATCH_PREFILL_TOKENS["cuda" if cuda else "cpu"]
            hints["max_batch_prefill_tokens"] = (f"auto ({cap:,})", cap) if cap else ("auto (no cap)", None)
        else:
            budget = max(OFFLINE_MAX_NUM_BATCHED_TOKENS, context or 0)
            hints["max_num_batched_tokens"] = (f"auto ({budget:,}: whole prompts)", budget)
            hints["max_batch_prefill_tokens"] = ("auto (no cap: whole prompts)", None)
        return hints

    def _show_auto_hints(self) -> None:
        for name, (text, value) in self.auto_hints().items():
            editor = self.editors.get(name)
            if editor is not None and editor.auto is not None:
                editor.set_auto_hint(text, value)

    def _show_problems(self) -> None:
        self._show_auto_hints()
        by_field = self.field_problems()
        for name, editor in self.editors.items():
            editor.error.setText("\n".join(by_field.get(name, [])))
            editor.error.setVisible(name in by_field)
        lines = self.warnings()
        if by_field:
            names = ", ".join(BASIC_LABELS.get(n, label_for(self.editors[n].flag)) +
                              ("" if n in BASIC else " (Advanced)") for n in by_field)
            lines.insert(0, f"Fix the settings marked in red before starting: {names}.")
        self.problems_label.setText("\n".join(lines))
        self.problems_label.setVisible(bool(lines))

    def _set_row_visible(self, name: str, visible: bool) -> None:
        (self._hidden.discard if visible else self._hidden.add)(name)
        editor = self.editors.get(name)
        form = self.forms.get(editor.flag.group) if editor else None
        if form is not None:
            form.setRowVisible(editor.row, visible)

    def _on_use_all_gpus(self, on: bool) -> None:
        editor = self.editors.get("tensor_parallel_size")
        if editor is not None and self.num_gpus > 1:
            editor.set_value(self.num_gpus if on else 1)

    def _sync_use_all_gpus(self) -> None:
        editor = self.editors.get("tensor_parallel_size")
        if editor is not None:
            self.use_all_gpus.blockSignals(True)
            self.use_all_gpus.setChecked(self.num_gpus > 1 and editor.value() == self.num_gpus)
            self.use_all_gpus.blockSignals(False)
