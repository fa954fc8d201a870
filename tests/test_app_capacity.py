"""The planner line follows the model picker: a path that holds no model clears it (issue 14 item 5),
and what it plans on CPU is what the CPU engine allocates (tests/test_memory_profiling.py compares them)."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

import json

from app.capacity import capacity_line
from app.model_picker import ModelPicker
from app.settings import default_values


def test_invalid_path_clears_the_plan(qtbot, llama_dir, tmp_path):
    picker = ModelPicker()
    qtbot.addWidget(picker)
    lines = []
    show = lambda *_: lines.append(capacity_line(picker.info.config if picker.info else None,  # noqa: E731
                                                 default_values(0), []))
    picker.model_changed.connect(show)
    picker.model_cleared.connect(show)
    assert picker.set_model_path(str(llama_dir))
    with qtbot.waitSignal(picker.model_cleared):
        assert not picker.set_model_path(str(tmp_path / "no-such-model"))
    assert "tokens fit" in lines[0] and lines[-1] == "Choose a model to see how much fits."


def test_cpu_line_for_a_tiny_model_reads_in_mib_not_zero_gib(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    line = capacity_line(config, {**default_values(0), "max_num_seqs": 4}, [])
    # The line names the pool the engine allocates (the Monitor's "KV cache" figure), then the budget it is under.
    from app.capacity import plan_for
    from engine.planning.units import format_bytes
    _where, plan = plan_for(config, {**default_values(0), "max_num_seqs": 4}, [])
    pool = format_bytes(plan.num_blocks * plan.kv_bytes_per_token * plan.block_size)
    assert line.startswith(f"CPU, no NVIDIA GPU: KV cache {pool} (of a 1 GiB budget: 4 full sequences need no more)"
                           " — weights ") and "MiB/card" in line
    assert "0.00 GiB" not in line and f"{4 * config['max_position_embeddings']:,} tokens fit" in line
