"""Engine settings: the GUI-visible flags of engine/config/flags.py, their values and their persistence.

Declared once: the list of settings is `FLAGS` filtered by `gui=True`, defaults are the flags'
defaults (tensor-parallel size defaults to the number of NVIDIA GPUs NVML finds, 1 without any), and
values are stored in QSettings under "engine/<flag name>". The form and the command line are both
derived from here, so the GUI and `pagedesk-serve` cannot drift apart.
"""
from __future__ import annotations

from typing import Any

from PySide6.QtCore import QSettings

from engine.config.flags import FLAGS, Flag, flags_to_argv

GROUP = "engine"


# Engine flags the form shows although the CLI marks them gui=False: the CPU engine's KV budget is the
# memory setting that applies on a machine without an NVIDIA GPU (the form shows it only there), and
# speculative decoding, whose JSON the form builds with an editor of its own (app/speculative_editor.py).
APP_FLAGS = ("kv_cache_memory", "speculative_config")


def gui_flags() -> tuple[Flag, ...]:
    return tuple(f for f in FLAGS if f.gui or f.name in APP_FLAGS)


def default_values(num_gpus: int) -> dict[str, Any]:
    values = {f.name: f.default for f in gui_flags()}
    values["tensor_parallel_size"] = max(1, num_gpus)
    return values


def _coerce(flag: Flag, raw: Any) -> Any:
    """QSettings hands back strings on some backends; turn them into the flag's type (None stays None)."""
    if raw is None or raw == "" or raw == "@Invalid()":
        return None
    if flag.type is bool:
        return raw if isinstance(raw, bool) else str(raw).lower() in ("true", "1", "yes")
    return flag.type(raw)


def load_values(settings: QSettings, num_gpus: int) -> dict[str, Any]:
    values = default_values(num_gpus)
    for f in gui_flags():
        key = f"{GROUP}/{f.name}"
        if settings.contains(key):
            try:
                values[f.name] = _coerce(f, settings.value(key))
            except (TypeError, ValueError):
                pass  # a corrupt stored value falls back to the default
    return values


def save_values(settings: QSettings, values: dict[str, Any]) -> None:
    for f in gui_flags():
        value = values.get(f.name)
        settings.setValue(f"{GROUP}/{f.name}", "" if value is None else value)
    settings.sync()


def serve_argv(model: str, values: dict[str, Any], extra: list[str] | None = None) -> list[str]:
    """Arguments after `python -m engine.entrypoints.serve`: the model, every non-default flag, then `extra`."""
    return ["--model", model, *flags_to_argv(values), *(extra or [])]
