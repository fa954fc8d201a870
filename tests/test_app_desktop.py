"""Desktop integration: the model library (local folders and the HF cache in one list, a "fits?"
verdict per model from the capacity planner), the XDG autostart entry, the theme that follows the
system's light/dark preference, the status chip's text, and `pagedesk --serve-at-login`'s flag."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

from types import SimpleNamespace

from PySide6.QtCore import QSettings
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QApplication

import app.model_library as library
from app.autostart import autostart_enabled, autostart_path, set_autostart
from app.demo_data import demo_model_folder
from app.main import parse_args
from app.model_library import FITS_COLUMN, ModelLibrary, fit_verdict, quantization_of, scan_library
from app.settings import default_values
from app.status_chip import StatusChip
from app.theme import apply_theme, is_dark
from widgets.time_plot import TimePlot

GIB = 2 ** 30


def qwen7b(tmp_path):
    demo_model_folder(tmp_path / "models" / "Qwen2.5-7B-Instruct")
    return scan_library([tmp_path / "models"], cache_dir=tmp_path / "no-cache")[0]


def test_library_lists_folders_with_their_description(tmp_path):
    entry = qwen7b(tmp_path)
    (tmp_path / "models" / "not-a-model").mkdir()
    assert [e.name for e in scan_library([tmp_path / "models"], tmp_path / "no-cache")] == ["Qwen2.5-7B-Instruct"]
    assert entry.source == "folder" and entry.size_bytes > 0
    assert entry.info.architecture == "Qwen2ForCausalLM" and entry.info.context_length == 32768
    assert quantization_of(entry.info.config) == "none (bfloat16)"
    assert quantization_of({"quantization_config": {"quant_method": "awq", "bits": 4}}) == "awq 4-bit"


def test_verdicts_come_from_the_planner(tmp_path):
    config = qwen7b(tmp_path).info.config
    assert fit_verdict(config, default_values(2), [24 * GIB] * 2).short.startswith("✔ one card · ")
    assert fit_verdict(config, default_values(2), [12 * GIB] * 2).short.startswith("✔ TP 2 (all cards) · ")
    too_small = fit_verdict(config, default_values(2), [6 * GIB] * 2)
    assert not too_small.fits and "not even one" in too_small.detail
    cpu = fit_verdict(config, default_values(0), [])
    assert cpu.detail.startswith("CPU") and not cpu.fits  # 32k tokens of fp32 KV exceed the 1 GiB CPU budget


def test_verdict_prefers_one_card_then_tp_then_fp8(monkeypatch):
    asked = []

    def planner(config, values, gpus):
        asked.append((values["tensor_parallel_size"], values["kv_cache_dtype"], values["max_model_len"]))
        fits = values["tensor_parallel_size"] == 2 and values["kv_cache_dtype"] == "fp8"
        plan = SimpleNamespace(fits=fits, num_tokens=50_000 if fits else 0, summary=lambda: "50,000 tokens fit",
                               explain_misfit=lambda: "not even one sequence fits")
        return "2 GPUs", plan

    monkeypatch.setattr(library, "plan_for", planner)
    verdict = fit_verdict({}, default_values(2), [10 * GIB] * 2)
    assert asked == [(1, "auto", None), (2, "auto", None), (1, "fp8", None), (2, "fp8", None)]
    assert verdict.fits and verdict.short == "✔ TP 2 + FP8 KV · 50,000 tokens"
    assert verdict.detail == "2 GPUs — 50,000 tokens fit"


def test_library_widget_fills_rows_and_hands_over_a_model(qtbot, tmp_path):
    qwen7b(tmp_path)
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    settings.setValue("library/folders", [str(tmp_path / "models")])
    widget = ModelLibrary(settings)
    qtbot.addWidget(widget)
    widget.refresh()
    widget.set_machine(default_values(2), [24 * GIB] * 2)
    row = next(r for r in range(widget.table.rowCount()) if widget.table.item(r, 0).text() == "Qwen2.5-7B-Instruct")
    assert widget.table.item(row, 4).text() == "7.62B" and widget.table.item(row, 6).text() == "32,768"
    assert widget.table.item(row, FITS_COLUMN).text().startswith("✔ one card")
    assert "tokens fit" in widget.table.item(row, FITS_COLUMN).toolTip()
    with qtbot.waitSignal(widget.model_chosen) as chosen:
        widget.table.cellDoubleClicked.emit(row, 0)
    assert chosen.args[0] == str(tmp_path / "models" / "Qwen2.5-7B-Instruct")


def test_autostart_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert not autostart_enabled()
    set_autostart(True)
    text = autostart_path().read_text()
    assert autostart_path() == tmp_path / "config" / "autostart" / "pagedesk.desktop"
    assert "[Desktop Entry]" in text and "--serve-at-login" in text and "Type=Application" in text
    set_autostart(False)
    assert not autostart_enabled()
    assert parse_args(["pagedesk", "--serve-at-login"]).serve_at_login


def test_theme_follows_the_preference(qtbot, monkeypatch):
    app = QApplication.instance()
    before = app.palette()
    try:
        monkeypatch.setenv("PAGEDESK_THEME", "dark")
        assert apply_theme(app) and is_dark()
        plot = TimePlot("x", [("a", "r")])
        qtbot.addWidget(plot)
        assert plot.backgroundBrush().color().lightness() < 100
        monkeypatch.setenv("PAGEDESK_THEME", "light")
        assert not apply_theme(app) and not is_dark()
        assert app.palette().color(QPalette.ColorRole.Base).lightness() > 200
        qtbot.waitUntil(lambda: plot.backgroundBrush().color().lightness() > 200)  # followed the switch
    finally:
        app.setPalette(before)


def test_status_chip(qtbot):
    chip = StatusChip()
    qtbot.addWidget(chip)
    chip.set_status("READY", "qwen", "http://127.0.0.1:8000/v1")
    assert chip.text() == "● READY · qwen · http://127.0.0.1:8000/v1" and "#3f8f4f" in chip.styleSheet()
    chip.set_status("CRASHED")
    assert chip.text() == "● CRASHED" and "#b8434f" in chip.styleSheet()
    assert chip.state == "CRASHED"


def test_library_rows_for_duplicate_unreadable_and_weightless_folders(qtbot, tmp_path):
    import os

    from app.model_library import PATH_COLUMN

    qwen7b(tmp_path)
    models = tmp_path / "models"
    os.symlink(models / "Qwen2.5-7B-Instruct", models / "qwen-link")  # the same folder reached twice
    broken = models / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,, "x": 1}')
    weightless = models / "no-weights"
    weightless.mkdir()
    (weightless / "config.json").write_text((models / "Qwen2.5-7B-Instruct" / "config.json").read_text())
    entries = scan_library([models, models], tmp_path / "no-cache")  # an added root that repeats another
    assert sorted(e.name for e in entries) == ["Qwen2.5-7B-Instruct", "broken", "no-weights"]
    bad = next(e for e in entries if e.name == "broken")
    assert bad.info is None and bad.problem == "unreadable: config.json is not valid JSON (line 1, column 59)"

    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    settings.setValue("library/folders", [str(models)])
    widget = ModelLibrary(settings)
    qtbot.addWidget(widget)
    widget.refresh()
    widget.set_machine(default_values(2), [24 * GIB] * 2)
    rows = {widget.table.item(r, 0).text(): r for r in range(widget.table.rowCount())}
    assert widget.table.item(rows["broken"], FITS_COLUMN).text() == \
        "✘ unreadable: config.json is not valid JSON (line 1, column 59)"
    assert widget.table.item(rows["no-weights"], FITS_COLUMN).text() == "✘ no weights"
    assert widget.table.item(rows["Qwen2.5-7B-Instruct"], FITS_COLUMN).text().startswith("✔ one card")
    assert widget.table.item(rows["no-weights"], PATH_COLUMN).text() == str(weightless)
    assert "1 more unreadable" in widget.summary.text()
    assert not widget.use_button.isEnabled()  # nothing selected
    widget.table.selectRow(rows["broken"])
    assert not widget.use_button.isEnabled()
    widget.table.selectRow(rows["Qwen2.5-7B-Instruct"])
    assert widget.use_button.isEnabled()


def test_an_empty_library_says_where_it_looks(qtbot, tmp_path, monkeypatch):
    monkeypatch.setattr(library, "cached_models", lambda cache_dir=None: [])
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    settings.setValue("library/folders", [str(tmp_path / "extra")])
    monkeypatch.setattr(library, "DEFAULT_ROOT", tmp_path / "no-models")
    widget = ModelLibrary(settings)
    qtbot.addWidget(widget)
    widget.refresh()
    text = widget.summary.text()
    assert text.startswith("No models found. Looked in ") and str(tmp_path / "extra") in text
    assert str(tmp_path / "no-models") in text and "Hugging Face cache" in text
