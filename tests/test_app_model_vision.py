"""Issue 35, Models tab: the "vision" column says which checkpoints take images (the tower the engine runs and the
image processor) with the tower's size, the bytes the planner counts in its tooltip; a VL folder without its
processor and a text model say they are served as text."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

import shutil

from PySide6.QtCore import QSettings

from app.model_info import read_model_info
from app.model_library import COLUMNS, VISION_COLUMN, ModelLibrary
from app.model_vision import vision_cell
from engine.config.model import ModelConfig
from engine.planning.vision import tower_params


def test_the_vision_column_names_the_tower_the_planner_counts(qtbot, tmp_path):
    from tiny_models import make_tiny_model
    from tiny_vl_models import make_tiny_vl_model
    models = tmp_path / "models"
    vl = make_tiny_vl_model(models, "qwen3_5-vl")
    bare = shutil.copytree(vl, models / "vl-without-processor")
    for name in ("preprocessor_config.json", "processor_config.json"):
        (bare / name).unlink(missing_ok=True)
    text = make_tiny_model(models / "text")
    cfg = ModelConfig.from_folder(vl)
    short, tip = vision_cell(read_model_info(vl))
    assert short.startswith("✔ images · tower ") and "planner counts" in tip and "qwen3_5" in tip
    assert tower_params(cfg.vision, cfg.hidden_size) > 0
    assert vision_cell(read_model_info(bare))[0] == "text only: no image processor"
    assert vision_cell(read_model_info(text))[0] == "—"

    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    settings.setValue("library/folders", [str(models)])
    widget = ModelLibrary(settings)
    qtbot.addWidget(widget)
    widget.refresh()
    assert widget.table.horizontalHeaderItem(VISION_COLUMN).text() == COLUMNS[VISION_COLUMN] == "Vision"
    cells = {widget.table.item(r, COLUMNS.index("Path")).text(): widget.table.item(r, VISION_COLUMN)
             for r in range(widget.table.rowCount())}
    assert cells[str(vl.resolve())].text() == short and cells[str(vl.resolve())].toolTip() == tip
    assert cells[str(bare.resolve())].text() == "text only: no image processor"
