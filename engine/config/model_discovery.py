"""Which models are on this machine: model folders under a root, and model repos in the Hugging Face cache.

Torch-free and Qt-free: the router (`pagedesk-serve --models-dir`) and the app's Models tab list models with
the same functions. A folder is a model when it has a config.json; a cached repo is one when a snapshot of it
has one (the newest such snapshot is served). A model is named on the endpoint as it is listed here: a
folder by its folder name, a hub repo by its id (`default_model_name`, which `pagedesk-serve`, the router and
the app share, so a copied snippet never carries a machine's path). Nothing here reads weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CachedModel:
    repo_id: str
    size_on_disk: int
    snapshot: Path


def default_model_name(model: str) -> str:
    """The name a model is served under when none is given: a local folder's name, a hub repo id as it is."""
    folder = Path(model).expanduser()
    return folder.resolve().name if folder.is_dir() else model


def model_folders(root: Path) -> list[Path]:
    """`root` itself when it is a model folder, else its direct subfolders that are."""
    root = Path(root)
    if (root / "config.json").is_file():
        return [root]
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "config.json").is_file())


def cached_models(cache_dir: str | Path | None = None) -> list[CachedModel]:
    """Model repos in the hub cache that have a usable snapshot, largest first; [] without a cache."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(cache_dir)
    except Exception:  # no cache folder yet, or an unreadable one: nothing to list
        return []
    found = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        snapshot = next((r.snapshot_path for r in revisions if (r.snapshot_path / "config.json").exists()), None)
        if snapshot is not None:
            found.append(CachedModel(repo.repo_id, repo.size_on_disk, snapshot))
    return sorted(found, key=lambda m: -m.size_on_disk)


def servable_models(models_dir: str | Path, cache_dir: str | Path | None = None) -> dict[str, Path]:
    """{library name: folder}: folders under `models_dir` by folder name, then cached repos by repo id (a folder
    wins a name clash: it is what the user put there)."""
    found = {folder.name: folder for folder in model_folders(Path(models_dir))}
    for cached in cached_models(cache_dir):
        found.setdefault(cached.repo_id, cached.snapshot)
    return found
