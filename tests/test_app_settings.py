"""Settings: the form has exactly one editor per GUI flag, values round-trip through the form and
QSettings, the command line comes from flags_to_argv, and the capacity line uses engine.planning."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

from PySide6.QtCore import QSettings

from app.capacity import capacity_line
from app.settings import default_values, gui_flags, load_values, save_values, serve_argv
from app.settings_form import SettingsForm
from engine.config.flags import FLAGS

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
            "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
REQUIRED = {"tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "kv_cache_dtype",
            "enable_chunked_prefill", "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens",
            "enforce_eager", "host", "port", "api_key"}


def test_form_is_built_from_gui_flags(qtbot):
    form = SettingsForm(gui_flags())
    qtbot.addWidget(form)
    assert set(form.editors) == {f.name for f in FLAGS if f.gui} | {"kv_cache_memory", "speculative_config"}
    assert REQUIRED <= set(form.editors)
    assert form.values() == {f.name: f.default for f in gui_flags()}  # defaults shown as-is ("auto" = None)
    assert "--gpu-memory-utilization" in form.editors["gpu_memory_utilization"].widget.toolTip()


def test_values_round_trip_form_and_qsettings(qtbot, tmp_path):
    form = SettingsForm(gui_flags())
    qtbot.addWidget(form)
    edited = {**default_values(2), "max_model_len": 4096, "kv_cache_dtype": "fp8", "enable_prefix_caching": False,
              "gpu_memory_utilization": 0.85, "port": 9001, "api_key": "sk-local", "max_num_batched_tokens": None}
    with qtbot.waitSignal(form.changed):
        form.set_values(edited)
    assert form.values() == edited
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    save_values(settings, form.values())
    reread = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    assert load_values(reread, num_gpus=0) == edited
    argv = serve_argv("/m", edited)
    assert argv[:2] == ["--model", "/m"]
    for expected in (["--tensor-parallel-size", "2"], ["--max-model-len", "4096"], ["--kv-cache-dtype", "fp8"],
                     ["--no-enable-prefix-caching"], ["--port", "9001"], ["--api-key", "sk-local"]):
        i = argv.index(expected[0])
        assert argv[i: i + len(expected)] == expected
    assert "--max-num-batched-tokens" not in argv and "--host" not in argv


def test_tensor_parallel_defaults_to_gpu_count():
    assert default_values(0)["tensor_parallel_size"] == 1
    assert default_values(2)["tensor_parallel_size"] == 2


def test_capacity_line_uses_engine_sizing():
    two_cards = capacity_line(LLAMA_8B, {**default_values(2), "max_model_len": 8192}, [24 * 2 ** 30] * 2)
    assert "2 GPUs" in two_cards and "GiB/card" in two_cards and "8,192-token sequences" in two_cards
    assert "KiB/token" in two_cards
    too_long = capacity_line(LLAMA_8B, default_values(1), [24 * 2 ** 30])
    assert "not even one" in too_long and "--max-model-len" in too_long
    cpu = capacity_line(LLAMA_8B, {**default_values(0), "max_model_len": 2048}, [])
    assert cpu.startswith("CPU, no NVIDIA GPU") and "tokens fit" in cpu
    assert capacity_line(None, default_values(0), []).startswith("Choose a model")
    assert "Cannot plan" in capacity_line({"architectures": ["GPT2LMHeadModel"]}, default_values(0), [])
