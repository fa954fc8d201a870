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


def test_fits_says_the_context_per_request_and_how_many_at_once(tiny_model_dir):
    """Issue 38, item 6: "262,144 tokens" for every model was max_num_seqs × the context, a cap. The column now
    says the longest context one request can have and how many such requests run at once — and, where the
    batch limit is lower, how many the memory would hold, which is where a dense, a hybrid and an MoE model
    differ (an MoE's KV per token, a hybrid's state pool out of the budget)."""
    import dataclasses
    import json

    from app.capacity import fits_words, plan_for
    from app.model_library import fit_verdict
    from app.settings import default_values

    texts, memory = {}, {}
    for arch in ("llama", "qwen3_5", "qwen3_moe"):
        config = json.loads((tiny_model_dir(arch) / "config.json").read_text())
        verdict = fit_verdict(config, default_values(0), [])
        _, plan = plan_for(config, {**default_values(0), "max_model_len": None}, [])
        memory[arch] = dataclasses.replace(plan, max_blocks=None).num_full_seqs
        texts[arch] = verdict.cell(256)
        assert texts[arch] == (f"✔ CPU · {plan.max_model_len:,} tokens per request · 256 at once "
                               f"(memory for {memory[arch]:,})")
        assert f"{plan.num_tokens:,}" not in texts[arch]  # the pool's token total is not what fits
    assert len(set(memory.values())) == 3, texts
    _, plan = plan_for(config, {**default_values(0), "max_model_len": None, "kv_cache_memory": 0.002}, [])
    assert fits_words(plan, 256) == f"{plan.max_model_len:,} tokens per request · {plan.num_full_seqs} at once"
