"""READY means the served model answers (issue 38, items 1 and 2): not while it loads, never for a model that
cannot load, and the form refuses beforehand what the engine would refuse — an MTP head the checkpoint lacks —
with the engine's own check. With several models the chip and the Loaded models tab say each one's state."""
import qt_helpers as helpers

import json
import os
import struct

import pytest
from PySide6.QtCore import QSettings

from app.demo_data import demo_model_folder
from app.supervisor import FAILED, READY, STARTING, EngineSupervisor

pytestmark = pytest.mark.skipif(os.name != "posix", reason="process groups are POSIX")


def start(sup, extra=(), **values):
    return sup.start("/models/Chat", {"host": "127.0.0.1", "port": helpers.free_port(), **values}, list(extra))


def test_ready_waits_for_the_model_to_answer(qtbot, monkeypatch):
    """Behind the router (a second model, as the app's served set adds it) /health answers at once while the
    main model is listed as loading for 1.5 s: the endpoint is up, but READY waits for the model."""
    monkeypatch.setenv("FAKE_SERVE_LOAD_S", "1.5")
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    progress, ups = [], []
    sup.progress.connect(progress.append)
    sup.endpoint_up.connect(ups.append)
    try:
        with qtbot.waitSignal(sup.ready, timeout=15_000):
            assert start(sup, ["--model", "Coder=/models/Coder"], api_key="sk-k")
            qtbot.waitUntil(lambda: "loading" in progress, timeout=10_000)
            assert sup.state == STARTING and ups == [sup.base_url]  # up, but not READY while it loads
        assert sup.state == READY and progress[-1] == "first request"
        assert sup.main_model == "/models/Chat"  # no such folder here: named as given, like a hub repo id
    finally:
        sup.shutdown()


def test_a_model_that_cannot_load_is_failed_never_ready(qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_MODE", "refuse")
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    readies = []
    sup.ready.connect(readies.append)
    try:
        with qtbot.waitSignal(sup.failed, timeout=15_000) as failed:
            assert start(sup)
        assert "no MTP weights" in failed.args[0] and sup.state == FAILED and sup.running
        qtbot.wait(1500)  # it keeps watching, and neither READY nor a second report follows
        assert readies == [] and sup.state == FAILED
        assert any("cannot serve" in line for line in sup.tail)
    finally:
        sup.shutdown()


@pytest.fixture
def window(qtbot, tmp_path):
    from app.main_window import MainWindow
    from app.served_set import ServedSet, save_served_set

    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    save_served_set(settings, ServedSet([str(tmp_path / "Coder")], model_ttl_minutes=10))
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    win = MainWindow(settings=settings, supervisor=sup, num_gpus=0, sample_gpus=False)
    qtbot.addWidget(win)
    demo_model_folder(tmp_path / "Chat")
    assert win.model_picker.set_model_path(str(tmp_path / "Chat"))
    win.settings_form.set_values({"port": helpers.free_port()})
    yield win
    win.shutdown()


def test_the_chip_and_the_loaded_models_tab_say_each_models_state(window, qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_MODE", "refuse")
    win = window
    with qtbot.waitSignal(win.supervisor.failed, timeout=15_000):
        assert win.start_engine()
    chip = win.state_label
    assert chip.full_text.startswith("● FAILED · Chat") and chip.state == FAILED
    assert chip.full_text.endswith("/v1")  # the endpoint itself is up: the other models still serve
    assert not win.crash_box.isHidden() and "Chat cannot serve" in win.crash_box.text()
    assert "no MTP weights" in win.crash_box.text()
    panel = win.loaded_models
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2, timeout=10_000)  # listed although never READY
    assert [panel.table.item(i, 1).text() for i in range(2)] == ["failed", "unloaded"]
    assert "no MTP weights" in panel.table.item(0, panel.table.columnCount() - 1).text()
    assert chip.full_text.startswith("● FAILED · Chat · 0 of 2 models loaded · http://")
    assert "Chat: failed — engine exited with code 2" in chip.toolTip() and "Coder: unloaded" in chip.toolTip()
    assert [win.chat.model_choice.combo.itemData(i) for i in range(win.chat.model_choice.combo.count())] == \
        ["Coder"]  # the picker offers only what is loaded or can load
    assert not win.start_action.isEnabled() and win.stop_action.isEnabled()
    with qtbot.waitSignal(win.supervisor.state_changed, timeout=5000, check_params_cb=lambda s: s == "STOPPED"):
        win.stop_engine()


def header_only_checkpoint(folder, config: dict, names: list[str]) -> None:
    """config.json and a safetensors file that has headers and no data (the app reads nothing else)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    header = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [0, 0]} for n in names}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)


def test_the_form_refuses_an_mtp_head_the_checkpoint_lacks(window, qtbot, tmp_path, tiny_model_dir):
    win = window
    form = win.settings_form
    editor = form.editors["speculative_config"]
    editor.method.setCurrentIndex(editor.method.findData("mtp"))
    problem = " ".join(form.field_problems()["speculative_config"])
    assert "Qwen2ForCausalLM has no multi-token-prediction head" in problem  # the engine's words
    assert not editor.error.isHidden() and not win.start_action.isEnabled()
    assert win.capacity.text().startswith("Cannot plan") and "draft" not in win.capacity.text()  # no phantom head
    assert not win.start_engine() and "no multi-token-prediction head" in win.statusBar().currentMessage()

    config = json.loads((tiny_model_dir("qwen3_5") / "config.json").read_text())
    header_only_checkpoint(tmp_path / "NoHead", config, ["model.embed_tokens.weight"])
    assert win.model_picker.set_model_path(str(tmp_path / "NoHead"))
    assert "has no MTP weights" in " ".join(form.field_problems()["speculative_config"])
    header_only_checkpoint(tmp_path / "WithHead", config, ["model.embed_tokens.weight", "mtp.fc.weight",
                                                           "mtp.layers.0.mlp.down_proj.weight"])
    assert win.model_picker.set_model_path(str(tmp_path / "WithHead"))
    assert "speculative_config" not in form.field_problems() and win.start_action.isEnabled()
