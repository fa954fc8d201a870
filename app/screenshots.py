"""`python -m app.screenshots docs/`: save PNGs of the main views, filled with labelled demo data.

Builds the real MainWindow offscreen (no engine, no NVML), feeds it synthetic engine states, GPU
readings, a chat and a log from app.demo_data, and grabs each tab: engine.png, models.png, chat.png,
monitor.png, endpoint.png, then monitor-kv-groups.png (the block map of a model with several KV cache groups). The data is illustrative; the widgets and layout are the real ones.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
if "PAGEDESK_DATA_DIR" not in os.environ:  # a throwaway data dir (removed at exit): never the user's chats
    _DATA_DIR = tempfile.TemporaryDirectory(prefix="pagedesk-screens-")
    os.environ["PAGEDESK_DATA_DIR"] = _DATA_DIR.name

from PySide6.QtCore import QSettings  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

LOG = """$ pagedesk-serve --model ~/models/Qwen2.5-7B-Instruct --max-model-len 16384 --tensor-parallel-size 2 \
--kv-cache-dtype fp8 --port 8000
Loading ~/models/Qwen2.5-7B-Instruct (device auto, dtype auto, tensor parallel 2) ...
rank 1: worker started (NCCL, peer-to-peer unavailable: falling back to host copies)
weights: 7.10 GiB per card in 3.8 s
profiling forward over 2048 tokens: peak activations 0.61 GiB per card
KV cache: 4096 blocks of 16 tokens (12.4 GiB per card, fp8)
Model loaded in 11.6 s
PagedDesk serving Qwen/Qwen2.5-7B-Instruct at http://127.0.0.1:8000/v1
"""

ANSWER = """**Paged attention** stores the KV cache in fixed-size *blocks* instead of one contiguous \
buffer per sequence, so memory is allocated as a sequence grows and freed blocks are reused at once.

```python
block_table = [17, 4, 92]          # logical block i -> physical block
slot = block_table[pos // 16] * 16 + pos % 16
```

Shared prompt prefixes point at the same physical blocks (ref count > 1), which is why the block map \
shows the system prompt's blocks in gold."""


def build_window():
    from app.demo_data import demo_gpu_readings, demo_model_folder, demo_states
    from app.main_window import MainWindow
    from app.supervisor import READY

    data = Path(os.environ["PAGEDESK_DATA_DIR"])
    settings = QSettings(str(data / "settings.ini"), QSettings.Format.IniFormat)
    model_dir = data / "models" / "Qwen2.5-7B-Instruct"
    demo_model_folder(model_dir)
    settings.setValue("library/folders", [str(data / "models")])
    win = MainWindow(settings=settings, num_gpus=2, sample_gpus=False)
    win.model_picker.set_model_path(str(model_dir))
    win.model_picker.path_edit.setText("~/models/Qwen2.5-7B-Instruct")  # the temp folder's name means nothing
    win.settings_form.set_values({"max_model_len": 16384, "kv_cache_dtype": "fp8", "api_key": "sk-local-demo",
                                  "served_model_name": "Qwen/Qwen2.5-7B-Instruct"})
    states = demo_states()
    for t, state in states:
        win.monitor.on_state(state, now=t)
        win.monitor.on_gpu_readings(demo_gpu_readings(t), now=t)
    win.gpu_memory = [r.memory_total for r in demo_gpu_readings()]
    win._update_capacity()
    win.log_view.setPlainText(LOG)
    win.supervisor.base_url = "http://127.0.0.1:8000"
    win.supervisor.state = READY  # as if the engine were up: the status chip and title show the live URL
    win._on_state(READY)
    win._update_endpoint(running=True)
    from app.loaded_models import ModelRow
    win.chat.set_models([ModelRow("Qwen/Qwen2.5-7B-Instruct", "loaded", "cuda:0 + cuda:1", 0, 16384, "none")])
    win.chat.set_endpoint(win.supervisor.base_url, "sk-local-demo", "Qwen/Qwen2.5-7B-Instruct")
    chat = win.chat.conversation_id
    win.chat.store.update_conversation(chat, title="Paged attention in two sentences")
    win.chat.store.add_message(chat, "user", "Explain paged attention in two sentences, with a tiny code example.")
    win.chat.store.add_message(chat, "assistant", ANSWER, "TTFT 142 ms · 61.3 tokens/s · 118 tokens · finish: stop",
                               "Qwen/Qwen2.5-7B-Instruct")
    win.chat.conversation_id = None
    win.chat._load_conversations()
    win.chat._on_context_used(161, 16384)  # the context meter after that reply
    return win


def _kv_groups_shot(app, win, out: Path) -> Path:
    """The monitor with a Gemma-3-27B-shaped pool: blocks coloured by KV cache group, under the group legend."""
    import dataclasses

    from app.demo_data import DEMO_GROUP_NAMES, demo_grouped_blocks, demo_states
    t, last = demo_states()[-1]
    state = dataclasses.replace(last, model="google/gemma-3-27b-it", blocks=demo_grouped_blocks(last.num_blocks),
                                kv_groups=list(DEMO_GROUP_NAMES))
    win.tabs.setCurrentIndex(win.tabs.indexOf(win.monitor))
    win.monitor.on_state(state, now=t + 0.25)
    win.monitor.block_map.redraw()
    for _ in range(5):
        app.processEvents()
    path = out / "monitor-kv-groups.png"
    win.grab().save(str(path))
    return path


def _hybrid_moe_shot(app, win, out: Path) -> Path:
    """The monitor for a hybrid MoE model speculating with MTP: state slots beside the block map, the
    acceptance plots and the expert-load heat map (all made-up demo data)."""
    from app.demo_data import demo_hybrid_moe_states
    win.tabs.setCurrentIndex(win.tabs.indexOf(win.monitor))
    monitor = win.monitor
    for plot in (monitor.kv_plot, monitor.queue_plot, monitor.tokens_plot):
        plot.clear_data()
    for t, state in demo_hybrid_moe_states():
        monitor.on_state(state, now=t)
    for widget in (monitor.kv_plot, monitor.queue_plot, monitor.tokens_plot, monitor.acceptance_plot,
                   monitor.accepted_length_plot, monitor.block_map, monitor.state_slots, monitor.expert_heatmap):
        widget.redraw()
    for _ in range(5):
        app.processEvents()
    path = out / "monitor-hybrid-moe.png"
    win.grab().save(str(path))
    return path


def save_screenshots(out_dir: str | Path) -> list[Path]:
    app = QApplication.instance() or QApplication(sys.argv[:1])
    from app.theme import apply_theme
    apply_theme(app)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    win = build_window()
    win.resize(1400, 900)
    win.show()
    saved = []
    tabs = {"engine": 0, "models": win.tabs.indexOf(win.library), "chat": win.tabs.indexOf(win.chat),
            "monitor": win.tabs.indexOf(win.monitor), "endpoint": win.tabs.indexOf(win.endpoint)}
    for name, index in tabs.items():
        win.tabs.setCurrentIndex(index)
        for plot in (win.monitor.kv_plot, win.monitor.queue_plot, win.monitor.tokens_plot, win.monitor.vram_plot):
            plot.redraw()
        win.monitor.block_map.redraw()
        for _ in range(5):
            app.processEvents()
        path = out / f"{name}.png"
        win.grab().save(str(path))
        saved.append(path)
    saved.append(_kv_groups_shot(app, win, out))
    saved.append(_hybrid_moe_shot(app, win, out))
    win.close()
    return saved


if __name__ == "__main__":
    for p in save_screenshots(sys.argv[1] if len(sys.argv) > 1 else "docs"):
        print(p)
