"""The settings form's editor for `--speculative-config`: a method, its token count, and a draft from the library.

The flag takes vLLM's JSON (engine/config/speculative.py); a user should not have to write it. This editor
offers the methods by name — off, n-gram (prompt lookup), a draft model picked from the model library (or
typed as a folder / hub repo id), or the MTP head the model's checkpoint carries (the families
engine/models/registry.py declares one for) — with the number of speculative tokens and, for n-gram, the longest
lookup, and turns them into the JSON the engine parses (and back). It speaks the form's editor interface
(`value`, `set_value`, `connect_changed`, `problem`, `row`), so the form treats it like any flag's editor. The MTP
head is refused here as the engine refuses it, by the engine's own check (engine/config/speculative.check_mtp_head:
a family that declares one, mtp.* tensors in the checkpoint's headers) on the chosen model (`set_model`). Whether
a draft fits the target (same vocabulary) is checked by the engine at start, which reports it by name.
"""
from __future__ import annotations

import json
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QFormLayout, QLabel, QSpinBox, QVBoxLayout, QWidget

from engine.config.flags import Flag
from engine.config.model import ModelConfig
from engine.config.speculative import MAX_SPECULATIVE_TOKENS, check_mtp_head, parse_speculative_config

OFF, NGRAM, DRAFT, MTP = "off", "ngram", "draft_model", "mtp"
METHOD_LABELS = {OFF: "Off", NGRAM: "N-gram (prompt lookup)", DRAFT: "Draft model", MTP: "MTP head (the model's own)"}
DEFAULT_K = 3


class SpeculativeEditor:
    def __init__(self, flag: Flag, wheel_guard) -> None:
        self.flag = flag
        self.auto = None  # the form's "auto" machinery does not apply
        self.method = QComboBox(objectName="speculative-method")
        for key, label in METHOD_LABELS.items():
            self.method.addItem(label, key)
        self.k = QSpinBox(objectName="speculative-k", minimum=1, maximum=MAX_SPECULATIVE_TOKENS, value=DEFAULT_K)
        self.lookup_max = QSpinBox(objectName="speculative-lookup-max", minimum=1, maximum=16, value=3)
        self.draft = QComboBox(objectName="speculative-draft", editable=True)
        self.draft.lineEdit().setPlaceholderText("a model folder or hub repo id with the target's tokenizer")
        for w in (self.method, self.k, self.lookup_max, self.draft):
            w.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
            w.installEventFilter(wheel_guard)
        self.method.setToolTip("Speculative decoding: a cheap proposer drafts tokens, the model verifies them in one "
                               "step, and the output stays exactly the model's. It pays at batch 1–8; off is the "
                               "default.")
        self.input = self.method  # what the form focuses
        self.target: tuple | None = None  # (architecture, text config, tensor names, where) of the chosen model
        self.widget = QWidget()
        form = QFormLayout(self.widget)
        form.setContentsMargins(0, 0, 0, 0)
        form.addRow(self.method)
        form.addRow("Speculative tokens", self.k)
        form.addRow("Longest lookup (tokens)", self.lookup_max)
        form.addRow("Draft model", self.draft)
        self._form = form
        self.error = QLabel(wordWrap=True, visible=False, objectName=f"{flag.name}-error")
        self.error.setStyleSheet("color: #bf616a;")
        self.row = QWidget()
        column = QVBoxLayout(self.row)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.widget)
        column.addWidget(self.error)
        self.method.currentIndexChanged.connect(self._show_fields)
        self._show_fields()

    def _show_fields(self) -> None:
        method = self.method.currentData()
        self._form.setRowVisible(self.k, method != OFF)
        self._form.setRowVisible(self.lookup_max, method == NGRAM)
        self._form.setRowVisible(self.draft, method == DRAFT)

    def set_model(self, info) -> None:
        """The chosen model (app.model_info.ModelInfo, or None), read as the engine reads it, for the MTP check."""
        self.target = None
        if info is not None:
            try:
                cfg = ModelConfig.from_hf_config(info.config)
            except (ValueError, KeyError, TypeError):  # the planner says why it cannot read the config
                return
            self.target = (cfg.architecture, cfg.hf_text_config, info.tensor_names, f"the checkpoint {info.path}")

    def set_draft_models(self, models: list[tuple[str, str]]) -> None:
        """The library's models as (name, folder); the typed or chosen draft is kept."""
        current = self._draft_text()
        self.draft.blockSignals(True)
        self.draft.clear()
        for name, path in models:
            self.draft.addItem(name, path)
        self._set_draft_text(current)
        self.draft.blockSignals(False)

    def _draft_text(self) -> str:
        i = self.draft.currentIndex()
        text = self.draft.currentText().strip()
        if i >= 0 and text == self.draft.itemText(i) and self.draft.itemData(i):
            return str(self.draft.itemData(i))  # a library entry: its folder
        return text

    def _set_draft_text(self, value: str) -> None:
        i = self.draft.findData(value)
        if i >= 0:
            self.draft.setCurrentIndex(i)
        else:
            self.draft.setEditText(value)

    def value(self) -> str | None:
        method = self.method.currentData()
        if method == OFF:
            return None
        config: dict[str, Any] = {"method": method, "num_speculative_tokens": self.k.value()}
        if method == NGRAM:
            config["prompt_lookup_max"] = self.lookup_max.value()
        if method == DRAFT:
            config["model"] = self._draft_text()
        return json.dumps(config)

    def set_value(self, value: Any) -> None:
        """The flag's JSON (or None: off). Text the editor cannot show (unparseable, unknown method) is off."""
        try:
            config = json.loads(value) if isinstance(value, str) and value.strip() else value or {}
        except json.JSONDecodeError:
            config = {}
        method = config.get("method") or (DRAFT if config.get("model") else OFF) if isinstance(config, dict) else OFF
        if method not in METHOD_LABELS:
            method = OFF
        self.method.setCurrentIndex(self.method.findData(method))
        self.k.setValue(int(config.get("num_speculative_tokens") or DEFAULT_K) if method != OFF else DEFAULT_K)
        self.lookup_max.setValue(int(config.get("prompt_lookup_max") or 3) if method == NGRAM else 3)
        self._set_draft_text(str(config.get("model") or "") if method == DRAFT else "")
        self._show_fields()

    def connect_changed(self, slot) -> None:
        self.method.currentIndexChanged.connect(lambda *_: slot())
        self.k.valueChanged.connect(lambda *_: slot())
        self.lookup_max.valueChanged.connect(lambda *_: slot())
        self.draft.currentTextChanged.connect(lambda *_: slot())

    def problem(self) -> str | None:
        """What the engine's parser would refuse, in its words (e.g. a draft model with no folder named)."""
        value = self.value()
        if value is None:
            return None
        if self.method.currentData() == DRAFT and not self._draft_text():
            return "Speculative decoding with a draft model needs the draft: pick one from the library or type a folder."
        try:
            parse_speculative_config(value)
            if self.method.currentData() == MTP and self.target is not None:
                check_mtp_head(*self.target)
        except ValueError as exc:
            return f"Speculative decoding: {exc}"
        return None
