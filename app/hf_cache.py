"""Models in the local Hugging Face hub cache, and downloading one by repo id off the GUI thread.

`cached_models()` (engine.model_discovery, shared with the router) lists model repos with their size and
the newest snapshot folder that has a config.json. `DownloadWorker.run` calls `snapshot_download` (on
a background thread of the caller's choosing) with a tqdm class that turns progress into signals
and raises when cancelled, so a cancel stops the download at its next progress update.
"""
from __future__ import annotations

from PySide6.QtCore import QObject, Signal
from tqdm.auto import tqdm

from engine.model_discovery import CachedModel, cached_models  # noqa: F401 - the app's names for them


class DownloadCancelled(Exception):
    pass


class DownloadWorker(QObject):
    """Downloads one repo; signals progress(done, total, unit), finished(path), failed(message)."""

    progress = Signal(float, float, str)
    finished = Signal(str)
    failed = Signal(str)

    def __init__(self, repo_id: str, cache_dir: str | None = None) -> None:
        super().__init__()
        self.repo_id = repo_id
        self.cache_dir = cache_dir
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def _tqdm_class(self) -> type:
        worker = self

        class SignalTqdm(tqdm):
            def __init__(self, *args, **kwargs):
                kwargs["disable"] = False
                kwargs["file"] = _NullFile()
                super().__init__(*args, **kwargs)

            def update(self, n=1):
                if worker.cancelled:
                    raise DownloadCancelled(f"download of {worker.repo_id} cancelled")
                result = super().update(n)
                worker.progress.emit(float(self.n), float(self.total or 0), str(self.unit))
                return result

        return SignalTqdm

    def run(self) -> None:
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(self.repo_id, cache_dir=self.cache_dir, tqdm_class=self._tqdm_class())
        except DownloadCancelled as e:
            self.failed.emit(str(e))
        except Exception as e:  # network, auth, missing repo: report, never crash the GUI
            self.failed.emit(f"download of {self.repo_id} failed: {type(e).__name__}: {e}")
        else:
            self.finished.emit(str(path))


class _NullFile:
    def write(self, _s: str) -> None:
        pass

    def flush(self) -> None:
        pass
