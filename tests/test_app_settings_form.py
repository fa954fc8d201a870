"""The settings form as a user meets it: the mouse wheel scrolls the form instead of editing unfocused
combo and spin boxes; an "auto" number can always go back to auto; out-of-range values are reported
rather than silently reverted; the memory setting shown is the one that applies (GPU utilization
with cards, the KV cache budget on CPU); a tiny or too-long context is called out; basic settings on
top with the rest under Advanced, and "use all GPUs" driving the tensor-parallel size."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QApplication

from app.settings import gui_flags
from app.settings_form import SettingsForm


def form(qtbot, num_gpus=0):
    f = SettingsForm(gui_flags())
    f.set_hardware(num_gpus)
    qtbot.addWidget(f)
    return f


def wheel(widget, steps=-3):
    event = QWheelEvent(QPointF(5, 5), QPointF(widget.mapToGlobal(QPoint(5, 5))), QPoint(), QPoint(0, 120 * steps),
                        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(widget, event)


def test_wheel_does_not_edit_unfocused_editors(qtbot):
    f = form(qtbot)
    f.show_advanced.setChecked(True)
    f.show()
    qtbot.waitExposed(f)
    combo, spin = f.editors["kv_cache_dtype"].input, f.editors["max_num_seqs"].input
    wheel(combo)
    wheel(spin)
    assert f.values()["kv_cache_dtype"] == "auto" and f.values()["max_num_seqs"] == 256
    spin.setFocus()
    qtbot.waitUntil(spin.hasFocus)
    wheel(spin, steps=1)
    assert f.values()["max_num_seqs"] != 256  # a focused editor still takes the wheel


def test_auto_numbers_can_return_to_auto(qtbot):
    f = form(qtbot)
    f.set_values({"max_model_len": 4096})
    assert f.values()["max_model_len"] == 4096 and not f.editors["max_model_len"].auto.isChecked()
    f.editors["max_model_len"].auto.setChecked(True)
    assert f.values()["max_model_len"] is None and not f.editors["max_model_len"].input.isEnabled()


def test_out_of_range_is_reported_not_reverted(qtbot):
    f = form(qtbot, num_gpus=1)
    f.editors["gpu_memory_utilization"].input.setValue(0.01)
    assert f.values()["gpu_memory_utilization"] == 0.01
    assert f.problems() == ["GPU memory utilization must be between 0.05 and 1; it is 0.01."]
    error = f.editors["gpu_memory_utilization"].error
    assert error.text() == f.problems()[0] and not error.isHidden()  # at its own field
    assert f.problems_label.text() == ("Fix the settings marked in red before starting: "
                                       "GPU memory utilization (Advanced).")
    f.editors["gpu_memory_utilization"].input.setValue(0.5)
    assert error.isHidden() and f.problems_label.isHidden()


def test_each_error_sits_under_its_field_and_the_first_gets_focus(qtbot):
    f = form(qtbot, num_gpus=1)
    f.show()
    f.set_model_context(32768)
    f.set_values({"max_model_len": 10_000_000, "gpu_memory_utilization": 0.01})
    context_error = f.editors["max_model_len"].error
    assert context_error.text() == "Context length 10,000,000 is longer than the model's 32,768 tokens."
    assert not context_error.isHidden() and not f.editors["gpu_memory_utilization"].error.isHidden()
    assert f.editors["max_num_seqs"].error.isHidden()
    # the error is in the same form row as its field, right under it
    row = f.editors["max_model_len"].row
    assert context_error.parent() is row and f.editors["max_model_len"].widget.parent() is row
    assert f.focus_first_problem() is row  # form order: the basic context length comes first
    f.set_values({"max_model_len": 4096})
    assert not f.show_advanced.isChecked()
    assert f.focus_first_problem() is f.editors["gpu_memory_utilization"].row
    assert f.show_advanced.isChecked()  # the field was under the closed Advanced section
    qtbot.waitUntil(lambda: f.editors["gpu_memory_utilization"].input.hasFocus(), timeout=2000)


def test_memory_setting_follows_the_hardware(qtbot):
    cpu = form(qtbot, num_gpus=0)
    assert not cpu.forms["cache"].isRowVisible(cpu.editors["gpu_memory_utilization"].row)
    assert cpu.forms["cache"].isRowVisible(cpu.editors["kv_cache_memory"].row)
    cpu.editors["gpu_memory_utilization"].input.setValue(0.01)
    assert cpu.problems() == []  # a setting that does not apply here blocks nothing
    gpu = form(qtbot, num_gpus=1)
    assert gpu.forms["cache"].isRowVisible(gpu.editors["gpu_memory_utilization"].row)
    assert not gpu.forms["cache"].isRowVisible(gpu.editors["kv_cache_memory"].row)


def test_short_and_too_long_contexts_are_called_out(qtbot):
    f = form(qtbot)
    f.set_model_context(32768)
    f.set_values({"max_model_len": 10})
    assert "very short" in f.warnings()[0] and f.problems() == []
    f.set_values({"max_model_len": 40000})
    assert f.problems() == ["Context length 40,000 is longer than the model's 32,768 tokens."]


def test_basic_and_advanced(qtbot):
    f = form(qtbot, num_gpus=2)
    f.show()
    qtbot.waitExposed(f)
    assert f.editors["max_model_len"].widget.isVisible() and f.editors["kv_cache_dtype"].widget.isVisible()
    assert not f.editors["max_num_seqs"].widget.isVisible()
    f.show_advanced.setChecked(True)
    assert f.editors["max_num_seqs"].widget.isVisible()
    assert f.use_all_gpus.isVisible()
    f.use_all_gpus.setChecked(False)
    assert f.values()["tensor_parallel_size"] == 1
    f.use_all_gpus.setChecked(True)
    assert f.values()["tensor_parallel_size"] == 2
    f.set_values({"tensor_parallel_size": 1})
    assert not f.use_all_gpus.isChecked()
    one = form(qtbot, num_gpus=1)
    assert not one.basic_form.isRowVisible(one.use_all_gpus)


def test_auto_fields_show_the_value_the_engine_will_use(qtbot):
    from app.settings import gui_flags
    from app.settings_form import SettingsForm

    form = SettingsForm(gui_flags())
    qtbot.addWidget(form)
    form.set_hardware(0)
    length, budget = form.editors["max_model_len"].input, form.editors["max_num_batched_tokens"].input
    assert length.text() == "auto (the model's context)" and not length.isEnabled()
    form.set_model_context(32768)
    assert length.text() == "auto (32,768)" and budget.text() == "auto (2,048)"
    assert form.editors["max_batch_prefill_tokens"].input.text() == "auto (32)"  # the CPU engine's cap
    assert form.editors["kv_cache_memory"].input.text() == "auto (1 GiB)"
    form.set_values({"enable_chunked_prefill": False})
    assert budget.text() == "auto (32,768: whole prompts)"
    form.editors["max_model_len"].auto.setChecked(False)  # off auto: it starts from the model's context, not 1
    assert form.values()["max_model_len"] == 32768 and length.text() == "32768"
    form.editors["max_model_len"].auto.setChecked(True)
    assert form.values()["max_model_len"] is None and length.text() == "auto (32,768)"
    form.set_hardware(2)
    assert form.editors["max_batch_prefill_tokens"].input.text() == "auto (no cap: whole prompts)"


def test_the_port_is_a_basic_setting(qtbot):
    from app.settings import gui_flags
    from app.settings_form import SettingsForm

    form = SettingsForm(gui_flags())
    qtbot.addWidget(form)
    port_row = form.editors["port"].row
    assert form.basic_form.indexOf(port_row) >= 0 and not form.show_advanced.isChecked()


def test_speculative_decoding_is_chosen_by_name_and_becomes_the_flags_json(qtbot, tmp_path):
    """Off by default (no flag on the command line); n-gram and a draft model from the library become vLLM's
    JSON, which the engine's parser accepts and which reads back into the same choices; a draft model with no
    draft named is a problem under its field, in the engine's terms."""
    import json

    from PySide6.QtCore import QSettings

    from app.settings import load_values, save_values, serve_argv
    from engine.config.speculative import parse_speculative_config
    f = form(qtbot)
    editor = f.editors["speculative_config"]
    assert f.values()["speculative_config"] is None and "--speculative-config" not in serve_argv("/m", f.values())
    editor.method.setCurrentIndex(editor.method.findData("ngram"))
    editor.k.setValue(5)
    ngram = json.loads(f.values()["speculative_config"])
    assert ngram == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}
    assert parse_speculative_config(f.values()["speculative_config"]).k == 5
    editor.method.setCurrentIndex(editor.method.findData("draft_model"))
    assert "needs the draft" in " ".join(f.field_problems()["speculative_config"])
    f.set_draft_models([("Qwen3-0.6B", "/models/Qwen3-0.6B"), ("Qwen3-8B", "/models/Qwen3-8B")])
    editor.draft.setCurrentIndex(0)
    value = f.values()["speculative_config"]
    assert json.loads(value) == {"method": "draft_model", "num_speculative_tokens": 5, "model": "/models/Qwen3-0.6B"}
    assert "speculative_config" not in f.field_problems()
    argv = serve_argv("/m", f.values())
    assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == "/models/Qwen3-0.6B"
    f.set_draft_models([("Qwen3-8B", "/models/Qwen3-8B")])  # a rescan keeps the chosen draft
    assert json.loads(f.values()["speculative_config"])["model"] == "/models/Qwen3-0.6B"
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    save_values(settings, f.values())
    again = form(qtbot)
    again.set_values(load_values(QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat), 0))
    assert again.values()["speculative_config"] == value
    again.set_values({"speculative_config": None})
    assert again.values()["speculative_config"] is None
