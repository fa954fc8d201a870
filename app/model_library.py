"""The Models tab: every model on this machine in one list, with a "fits?" verdict for this machine.

Rows come from local folders (the roots the user added, default ~/models; a root that is itself a
model folder counts too), GGUF files under those roots and in LM Studio's and llama.cpp's default folders
(engine.config.model_discovery.gguf_roots), and the Hugging Face cache (`app.hf_cache`, GGUF repos too), each
described from its config.json and safetensors headers, or its GGUF header, only (`app.model_info`): a GGUF row
shows llama.cpp's quant name with each tensor type's share, and one the engine cannot serve (an architecture it
does not have, a type it does not read) says so instead of a verdict; size on disk, architecture, parameters,
quantization, context (an MoE model's parameters with the active share), and whether it takes images
(`app.model_vision`: the vision tower the engine runs, with the image processor; the tower's size, which the
planner counts). The verdict asks the capacity
planner (`app.capacity.plan_for`, the engine's own arithmetic) about the model's full context for a few
layouts in order of preference — one card, all cards (tensor parallel), then each with an FP8 KV cache;
on a machine without cards, the CPU — and names the first that fits with what fits in words
(`app.capacity.fits_words`: the longest context one request can have, and how many at once); the planner's
full sentence is the cell's tooltip. Downloads in
progress (started in the Engine tab) are rows too, and the list rescans when one ends. Double-click
(or "Use this model", enabled only with a usable row selected) hands the folder to the Engine tab.
Every row shows its folder, and a folder reached twice (an added root inside another, a symlink) is
listed once, by its resolved path. A folder whose config.json cannot be read is still a row, saying why
("unreadable: config.json is not valid JSON (line 1, column 82)"); one without safetensors weights gets
a "no weights" verdict, never "fits". An empty library says where it looked.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QHeaderView, QLabel, QPushButton, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from app.capacity import cannot_plan, describe, fits_words, plan_for
from app.hf_cache import cached_models
from app.model_info import ModelInfo, format_count, read_model_info
from app.model_vision import vision_cell
from app.units import plural
from engine.quantization.gguf.types import SUPPORTED_TYPES
from engine.config.model_discovery import GgufRoot, cached_gguf_files, gguf_files, gguf_roots, model_folders
from widgets.gpu_panel import format_bytes

COLUMNS = ("Model", "Source", "Size", "Architecture", "Parameters", "Quantization", "Context", "Vision",
           "Fits on this machine", "Path")
FITS_COLUMN = COLUMNS.index("Fits on this machine")
VISION_COLUMN = COLUMNS.index("Vision")
PATH_COLUMN = COLUMNS.index("Path")
FOLDERS_KEY = "library/folders"
DEFAULT_ROOT = Path.home() / "models"


@dataclass
class LibraryEntry:
    name: str
    source: str  # "folder" | "HF cache"
    size_bytes: int
    info: ModelInfo | None  # None when the folder could not be read (see `problem`)
    path: Path | None = None
    problem: str = ""  # "unreadable: …", naming the file
    has_weights: bool = True
    unsupported: str = ""  # a GGUF the engine reads but cannot serve: "not supported: Q2_K tensors"


@dataclass(frozen=True)
class Verdict:
    fits: bool
    short: str  # the layout and the tokens its KV pool holds, e.g. "✔ one card · 412,000 tokens"
    detail: str  # the planner's sentence for the chosen layout
    plan: Any = None  # the chosen layout's CapacityPlan, which the cell puts in words

    def cell(self, max_num_seqs: int) -> str:
        """What the table says: the layout, then what fits in words (or why nothing does)."""
        if self.plan is None or not self.fits:
            return self.short
        return f"{self.short.split(' · ')[0]} · {fits_words(self.plan, max_num_seqs)}"


def quantization_of(config: dict, dtype: str | None = None) -> str:
    """"awq 4-bit", or "none (bfloat16)" with the float dtype (`dtype`: ModelInfo's, which reads both spellings)."""
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        bits = quant.get("bits") or quant.get("weight_bits")
        return f"{quant.get('quant_method', 'quantized')}" + (f" {bits}-bit" if bits else "")
    return f"none ({dtype or config.get('torch_dtype') or config.get('dtype') or 'unknown'})"


def parameters_text(info: ModelInfo) -> str:
    """"7.62B", or an MoE model's "30.53B (3.34B active)"."""
    if not info.num_parameters:
        return "?"
    active = f" ({format_count(info.active_parameters)} active)" if info.active_parameters else ""
    return format_count(info.num_parameters) + active


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def gguf_size(path: Path) -> int:
    """A GGUF file's bytes, every part of a split set counted."""
    from engine.config.gguf_file import split_parts
    try:
        return sum(p.stat().st_size for p in split_parts(path))
    except ValueError:  # a missing part: the row says so
        return path.stat().st_size


def has_weights(folder: Path) -> bool:
    """Safetensors weights are there (the engine loads nothing else)."""
    return any(folder.glob("*.safetensors"))


def read_gguf_entry(name: str, source: str, path: Path, size_bytes: int) -> LibraryEntry:
    """One GGUF file's row; a damaged file (truncated, a missing split part) says why."""
    try:
        info = read_model_info(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return LibraryEntry(name, source, size_bytes, None, path,
                            f"unreadable: {(str(e).strip().splitlines() or [type(e).__name__])[0]}")
    unsupported = info.quantization.split(" · not supported: ")[1] if "not supported" in info.quantization else ""
    reason = (f"not supported: {unsupported} tensors" if unsupported else
              f"not supported: {info.architecture}" if not info.config else "")
    return LibraryEntry(name, source, size_bytes, info, path, unsupported=reason)


def read_entry(name: str, source: str, folder: Path, size_bytes: int) -> LibraryEntry:
    """One row: the model's description, or why it cannot be read (naming the file and the JSON position)."""
    if folder.suffix.lower() == ".gguf":
        return read_gguf_entry(name, source, folder, size_bytes)
    try:
        json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        return LibraryEntry(name, source, size_bytes, None, folder,
                            f"unreadable: config.json is not valid JSON (line {e.lineno}, column {e.colno})")
    except (OSError, UnicodeDecodeError) as e:
        return LibraryEntry(name, source, size_bytes, None, folder, f"unreadable: config.json: {e}")
    try:
        info = read_model_info(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return LibraryEntry(name, source, size_bytes, None, folder,
                            f"unreadable: {(str(e).strip().splitlines() or [type(e).__name__])[0]}")
    return LibraryEntry(name, source, size_bytes, info, folder, has_weights=has_weights(folder))


def scan_library(roots: list[Path], cache_dir: str | Path | None = None,
                 gguf_roots: list[GgufRoot] | None = None) -> list[LibraryEntry]:
    """Local model folders under `roots`, GGUF files under them and under `gguf_roots` (LM Studio's and llama.cpp's
    folders), and the hub cache's models and GGUF files, each resolved path once."""
    entries: list[LibraryEntry] = []
    seen: set[Path] = set()
    found = [(folder.name, "folder", folder, None) for root in roots for folder in model_folders(root)]
    found += [(c.repo_id, "HF cache", c.snapshot, c.size_on_disk) for c in cached_models(cache_dir)]
    gguf_sources = [GgufRoot(root, "folder") for root in roots] + list(gguf_roots or [])
    found += [(f.stem, f"GGUF ({r.source})", f, None) for r in gguf_sources for f in gguf_files(r.path)]
    found += [(f"{repo} {f.name}", "GGUF (HF cache)", f, None) for repo, f in cached_gguf_files(cache_dir)]
    for name, source, folder, size in found:
        if folder.resolve() in seen:
            continue
        seen.add(folder.resolve())
        try:
            size = gguf_size(folder) if folder.suffix.lower() == ".gguf" else folder_size(folder) if size is None \
                else size
        except OSError:
            size = 0
        entries.append(read_entry(name, source, folder, size))
    return entries


def hf_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def fit_verdict(config: dict, values: dict[str, Any], gpu_memory_bytes: list[int]) -> Verdict:
    """The first layout that holds one full-context sequence, asked of the capacity planner."""
    num_gpus = len(gpu_memory_bytes)
    layouts = [(1, "auto", "one card" if num_gpus else "CPU")]
    if num_gpus > 1:
        layouts.append((num_gpus, "auto", f"TP {num_gpus} (all cards)"))
    if num_gpus:
        layouts.append((1, "fp8", "one card + FP8 KV"))
    if num_gpus > 1:
        layouts.append((num_gpus, "fp8", f"TP {num_gpus} + FP8 KV"))
    line = ""
    for tp, kv_dtype, name in layouts:
        trial = {**values, "tensor_parallel_size": tp, "kv_cache_dtype": kv_dtype, "max_model_len": None}
        try:
            where, plan = plan_for(config, trial, gpu_memory_bytes)
        except (ValueError, KeyError, TypeError) as e:
            return Verdict(False, "? cannot plan", cannot_plan(e))
        line = describe(where, plan, values.get("kv_offloading_size"))
        if plan.fits:
            return Verdict(True, f"✔ {name} · {plan.num_tokens:,} tokens", line, plan)
    return Verdict(False, "✘ full context does not fit", line)


class ModelLibrary(QWidget):
    model_chosen = Signal(str)  # a model folder
    serve_alongside = Signal(str)  # a model folder to serve beside the chosen one (app/served_set.py)
    models_found = Signal(list)  # [(name, folder)] of the readable models, after each scan

    def __init__(self, settings: QSettings | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        self.entries: list[LibraryEntry] = []
        self.values: dict[str, Any] = {}
        self.gpu_memory: list[int] = []
        self.downloads: dict[str, str] = {}  # repo id -> progress text
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.cellDoubleClicked.connect(lambda row, _col: self._choose(row))
        self.summary = QLabel(wordWrap=True)
        add = QPushButton("Add folder…", clicked=self._add_folder)
        rescan = QPushButton("Rescan", clicked=self.refresh)
        use = self.use_button = QPushButton("Use this model", clicked=lambda: self._choose(self.table.currentRow()),
                                            enabled=False)
        alongside = self.alongside_button = QPushButton(
            "Serve alongside", enabled=False, toolTip="Serve this model too, behind the same endpoint (next Start)",
            clicked=lambda: self._choose(self.table.currentRow(), self.serve_alongside))
        self.table.itemSelectionChanged.connect(self._update_use_button)
        buttons = QHBoxLayout()
        for b in (add, rescan):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(alongside)
        buttons.addWidget(use)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)

    def roots(self) -> list[Path]:
        stored = self.settings.value(FOLDERS_KEY, []) if self.settings is not None else []
        stored = [stored] if isinstance(stored, str) else list(stored or [])
        return [DEFAULT_ROOT, *(Path(p) for p in stored)]

    def refresh(self) -> None:
        self.entries = scan_library(self.roots(), gguf_roots=gguf_roots())
        self._fill()
        self.models_found.emit([(e.name, str(e.path)) for e in self.entries if e.info is not None and e.has_weights])

    def set_machine(self, values: dict[str, Any], gpu_memory_bytes: list[int]) -> None:
        """New settings or card sizes: the verdicts are recomputed (the scan is not repeated)."""
        self.values, self.gpu_memory = dict(values), list(gpu_memory_bytes)
        self._fill()

    def show_download(self, repo_id: str, progress: str) -> None:
        self.downloads[repo_id] = progress
        self._fill()

    def end_download(self, repo_id: str, message: str) -> None:
        self.downloads.pop(repo_id, None)
        self.refresh()

    def _fill(self) -> None:
        cards = len(self.gpu_memory)
        where = (f"{plural(cards, 'NVIDIA GPU')}, smallest {format_bytes(min(self.gpu_memory))}"
                 if self.gpu_memory else "CPU only (no NVIDIA GPU found)")
        unreadable = sum(1 for e in self.entries if e.info is None)
        if self.entries or self.downloads:
            found = len(self.entries) - unreadable
            self.summary.setText(f"{plural(found, 'model')} found"
                                 + (f" ({unreadable} more unreadable)" if unreadable else "") +
                                 f" · verdicts for this machine: {where}, each model at its full context length.")
        else:
            looked = ", ".join(str(p).replace(str(Path.home()), "~", 1) for p in self.roots())
            self.summary.setText(f"No models found. Looked in {looked} and the Hugging Face cache ({hf_cache_dir()}). "
                                 "Add a folder of models, or download one by repo id in the Engine tab.")
        self.table.setRowCount(len(self.entries) + len(self.downloads))
        for row, (repo_id, progress) in enumerate(self.downloads.items(), start=len(self.entries)):
            for col, text in enumerate((repo_id, "download", "", "", "", "", "", f"⬇ downloading {progress}")):
                self.table.setItem(row, col, QTableWidgetItem(text))
        for row, e in enumerate(self.entries):
            info = e.info
            if info is None:
                verdict = Verdict(False, f"✘ {e.problem}", f"{e.path}: {e.problem}")
                cells = (e.name, e.source, format_bytes(e.size_bytes), "", "", "", "", "", verdict.short, str(e.path))
                vision = ("", "")
            else:
                if e.unsupported:
                    verdict = Verdict(False, f"✘ {e.unsupported}", f"{e.path}: the engine cannot serve this file "
                                      f"({e.unsupported}; it reads {', '.join(SUPPORTED_TYPES)})")
                elif e.has_weights:
                    verdict = fit_verdict(info.config, self.values, self.gpu_memory)
                else:
                    verdict = Verdict(False, "✘ no weights", f"{e.path} has no *.safetensors weight files: the "
                                      "engine cannot load it. Download the weights into it, or choose another folder.")
                quant = info.quantization if info.dtype == "gguf" else quantization_of(info.config, info.dtype)
                vision = vision_cell(info)
                cells = (e.name, e.source, format_bytes(e.size_bytes), info.architecture, parameters_text(info),
                         quant,
                         f"{info.context_length:,}" if info.context_length else "?", vision[0],
                         verdict.cell(int(self.values.get("max_num_seqs") or 256)), str(e.path))
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setData(Qt.ItemDataRole.UserRole, str(e.path))
                if col == VISION_COLUMN:
                    item.setToolTip(vision[1])
                if col == FITS_COLUMN:
                    item.setToolTip(verdict.detail)
                    item.setForeground(Qt.GlobalColor.darkGreen if verdict.fits else Qt.GlobalColor.darkRed)
                self.table.setItem(row, col, item)
        self._update_use_button()

    def _usable(self, row: int) -> bool:
        return 0 <= row < len(self.entries) and self.entries[row].info is not None \
            and not self.entries[row].unsupported

    def _update_use_button(self) -> None:
        rows = {index.row() for index in self.table.selectionModel().selectedRows()}
        usable = len(rows) == 1 and self._usable(next(iter(rows)))
        self.use_button.setEnabled(usable)
        self.alongside_button.setEnabled(usable)

    def _choose(self, row: int, signal=None) -> None:
        if self._usable(row):
            (signal or self.model_chosen).emit(str(self.entries[row].path))

    def _add_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a folder of models (or one model folder)")
        if folder and self.settings is not None:
            stored = [str(p) for p in self.roots()[1:]]
            self.settings.setValue(FOLDERS_KEY, [*stored, folder])
        if folder:
            self.refresh()
