"""The set of models the app serves behind its one endpoint: the chosen model, others served alongside it,
the idle time after which a model is unloaded (or put to sleep), and one copy per card.

Stored in QSettings under "serve/". With nothing alongside and one copy, `router_argv` adds nothing and the
app runs today's single `pagedesk-serve` engine; otherwise it adds the router's flags (engine/entrypoints/router): each
model as `--model NAME=PATH` (NAME its folder's name, made unique), `--model-ttl SECONDS` (with
`--model-ttl-action sleep` when an idle model should sleep: weights in CPU RAM, woken by its next request), and
`--data-parallel-size N` with one card per copy. The chosen model keeps the name it has alone (its served
name, else its path), so clients and the chat do not see it renamed when a second model joins. Tray and
serve-at-login start from the same saved settings, so they serve the same set.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QSettings

GROUP = "serve"


@dataclass
class ServedSet:
    alongside: list[str] = field(default_factory=list)  # model folders served next to the chosen one
    model_ttl_minutes: int = 0  # 0: never unload
    one_copy_per_card: bool = False
    ttl_sleeps: bool = False  # the idle time puts a model to sleep instead of unloading it

    def uses_router(self, num_gpus: int) -> bool:
        return bool(self.alongside) or self.model_ttl_minutes > 0 or (self.one_copy_per_card and num_gpus > 1)

    def names(self, primary_name: str) -> dict[str, str]:
        """{NAME: folder} of the models served alongside, named by folder and never clashing with the chosen one."""
        taken, named = {primary_name}, {}
        for folder in self.alongside:
            base = Path(folder.rstrip("/")).name or "model"
            name, i = base, 2
            while name in taken:
                name, i = f"{base}-{i}", i + 1
            taken.add(name)
            named[name] = folder
        return named

    def router_argv(self, primary_name: str, num_gpus: int) -> list[str]:
        """Flags after the chosen model's own: [] when one engine serves it alone."""
        if not self.uses_router(num_gpus):
            return []
        argv = [arg for name, folder in self.names(primary_name).items() for arg in ("--model", f"{name}={folder}")]
        if self.model_ttl_minutes > 0:
            argv += ["--model-ttl", str(self.model_ttl_minutes * 60)]
            argv += ["--model-ttl-action", "sleep"] if self.ttl_sleeps else []
        if self.one_copy_per_card and num_gpus > 1:
            argv += ["--data-parallel-size", str(num_gpus), "--tensor-parallel-size", "1"]
        return argv


def load_served_set(settings: QSettings) -> ServedSet:
    raw = settings.value(f"{GROUP}/alongside", [])
    alongside = [raw] if isinstance(raw, str) and raw else [str(p) for p in raw or [] if p]
    try:
        ttl = max(0, int(settings.value(f"{GROUP}/model_ttl_minutes", 0) or 0))
    except (TypeError, ValueError):
        ttl = 0
    one = str(settings.value(f"{GROUP}/one_copy_per_card", False)).lower() in ("true", "1")
    sleeps = str(settings.value(f"{GROUP}/ttl_sleeps", False)).lower() in ("true", "1")
    return ServedSet(alongside, ttl, one, sleeps)


def save_served_set(settings: QSettings, served: ServedSet) -> None:
    settings.setValue(f"{GROUP}/alongside", list(served.alongside))
    settings.setValue(f"{GROUP}/model_ttl_minutes", served.model_ttl_minutes)
    settings.setValue(f"{GROUP}/one_copy_per_card", served.one_copy_per_card)
    settings.setValue(f"{GROUP}/ttl_sleeps", served.ttl_sleeps)
    settings.sync()
