"""Which models are on this machine: model folders under a root, GGUF files, and model repos in the Hugging Face cache.

Torch-free and Qt-free: the router (`pagedesk-serve --models-dir`) and the app's Models tab list models with
the same functions. A folder is a model when it has a config.json; a cached repo is one when a snapshot of it
has one (the newest such snapshot is served). A GGUF model is a `.gguf` file (a split set counts once, by its
first part; llama.cpp's multimodal projectors `mmproj*.gguf` are no models) anywhere under a root, and the
apps people move from keep theirs in known places (`gguf_roots`: LM Studio's and llama.cpp's default folders). A model is named on the endpoint as it is listed here: a
folder by its folder name, a hub repo by its id (`default_model_name`, which `pagedesk-serve`, the router and
the app share, so a copied snippet never carries a machine's path). Nothing here reads weights.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.config.gguf_file import SPLIT_NAME


@dataclass(frozen=True, slots=True)
class CachedModel:
    repo_id: str
    size_on_disk: int
    snapshot: Path


def default_model_name(model: str) -> str:
    """The name a model is served under when none is given: a local folder's name, a GGUF file's name without
    `.gguf` (and a split set's part suffix), a hub repo id as it is."""
    folder = Path(model).expanduser()
    if folder.is_file() and folder.suffix.lower() == ".gguf":
        split = SPLIT_NAME.match(folder.name)
        return split["stem"] if split else folder.stem
    return folder.resolve().name if folder.is_dir() else model


def model_folders(root: Path) -> list[Path]:
    """`root` itself when it is a model folder, else its direct subfolders that are."""
    root = Path(root)
    if (root / "config.json").is_file():
        return [root]
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "config.json").is_file())


def _cached_model_repos(cache_dir: str | Path | None) -> list:
    """The hub cache's model repos (huggingface_hub's CachedRepoInfo); [] without a cache."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(cache_dir)
    except Exception:  # no cache folder yet, or an unreadable one: nothing to list
        return []
    return [repo for repo in info.repos if repo.repo_type == "model"]


def cached_models(cache_dir: str | Path | None = None) -> list[CachedModel]:
    """Model repos in the hub cache that have a usable snapshot, largest first; [] without a cache."""
    found = []
    for repo in _cached_model_repos(cache_dir):
        revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        snapshot = next((r.snapshot_path for r in revisions if (r.snapshot_path / "config.json").exists()), None)
        if snapshot is not None:
            found.append(CachedModel(repo.repo_id, repo.size_on_disk, snapshot))
    return sorted(found, key=lambda m: -m.size_on_disk)


def servable_models(models_dir: str | Path, cache_dir: str | Path | None = None) -> dict[str, Path]:
    """{library name: folder or GGUF file}: folders under `models_dir` by folder name, GGUF files there by file
    name, then cached repos by repo id (a folder wins a name clash: it is what the user put there)."""
    found = {folder.name: folder for folder in model_folders(Path(models_dir))}
    for file in gguf_files(Path(models_dir), max_depth=2):
        found.setdefault(default_model_name(str(file)), file)
    for cached in cached_models(cache_dir):
        found.setdefault(cached.repo_id, cached.snapshot)
    return found


@dataclass(frozen=True, slots=True)
class GgufRoot:
    path: Path
    source: str  # how the app names where the file came from: "LM Studio", "llama.cpp", "folder"


def gguf_roots() -> list[GgufRoot]:
    """The default folders of the GGUF apps people come from, those that exist: LM Studio (~/.lmstudio/models,
    and ~/.cache/lm-studio/models before 0.3), llama.cpp's download cache ($LLAMA_CACHE, else the platform cache
    folder's llama.cpp)."""
    home = Path.home()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache")
    if sys.platform == "darwin":
        cache = home / "Library" / "Caches"
    candidates = [GgufRoot(home / ".lmstudio" / "models", "LM Studio"),
                  GgufRoot(home / ".cache" / "lm-studio" / "models", "LM Studio"),
                  GgufRoot(Path(os.environ.get("LLAMA_CACHE") or cache / "llama.cpp"), "llama.cpp")]
    return [r for r in candidates if r.path.is_dir()]


def gguf_files(root: Path, max_depth: int = 4) -> list[Path]:
    """GGUF model files under `root` (or `root` itself when it is one), a split set by its first part, sorted."""
    root = Path(root)
    if root.is_file():
        return [root] if _is_gguf_model(root) else []
    if not root.is_dir():
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        depth = len(Path(dirpath).relative_to(root).parts)
        if depth >= max_depth:
            dirnames[:] = []
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath) / f for f in filenames if _is_gguf_model(Path(dirpath) / f)]
    return sorted(found)


def _is_gguf_model(path: Path) -> bool:
    name = path.name.lower()
    if not name.endswith(".gguf") or name.startswith("mmproj") or "-mmproj" in name:
        return False
    split = SPLIT_NAME.match(path.name)
    return split is None or int(split["no"]) == 1


def cached_gguf_files(cache_dir: str | Path | None = None) -> list[tuple[str, Path]]:
    """(repo id, file) for every GGUF model file in the hub cache's newest snapshot of each model repo."""
    found = []
    for repo in _cached_model_repos(cache_dir):
        if not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        found += [(repo.repo_id, f) for f in gguf_files(newest.snapshot_path)]
    return found
