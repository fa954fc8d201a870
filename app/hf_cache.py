"""Models in the local Hugging Face hub cache, and downloading one by repo id off the GUI thread.

`cached_models()` (engine.config.model_discovery, shared with the router) lists model repos with their size and
the newest snapshot folder that has a config.json. `DownloadWorker.run` calls `snapshot_download` (on
a background thread of the caller's choosing) with a tqdm class that turns progress into signals
and raises when cancelled, so a cancel stops the download at its next progress update. A failure is
told in words (`download_error_text`: offline, gated, no such repo, not authorised, disk full, ...), never
as an exception's class name. A repo of GGUF files (bartowski's, Unsloth's: one file per quant) is offered file by
file: `RepoListWorker` lists them with their quant and size (`gguf_files_of`, a split set as one), and the
worker then downloads only the chosen one's parts.
"""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal
from tqdm.auto import tqdm

from engine.config.model_discovery import CachedModel, cached_models  # noqa: F401 - the app's names for them


class DownloadCancelled(Exception):
    pass


# llama.cpp's quant names as GGUF repos spell them in file names (bartowski, Unsloth, lmstudio-community, ...)
QUANT_IN_NAME = re.compile(r"(?i)(?:^|[-_.])(UD-)?(I?Q\d_(?:K_[SMLX]L?|K|[01]|NL|XXS|XS|S|M|L)|MXFP4(?:_MOE)?|BF16|F16|F32)"
                           r"(?=[-_.])")
SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass(frozen=True)
class RepoGguf:
    """One GGUF model of a hub repo: its file (the first part of a split set), every part, their bytes together
    and the quant named in the file name ("Q4_K_M", "UD-Q4_K_XL", "IQ4_XS"; "" when the name has none)."""
    file: str
    parts: tuple[str, ...]
    size: int
    quant: str

    def label(self) -> str:
        from widgets.gpu_panel import format_bytes
        return f"{self.quant or 'GGUF'} · {format_bytes(self.size)} · {self.file}"


def gguf_files_of(entries: list[tuple[str, int]]) -> list[RepoGguf]:
    """The GGUF models among a repo's (path, size) files, a split set as one, smallest first; projectors
    (mmproj*) are not models."""
    groups: dict[str, list[tuple[str, int]]] = {}
    for path, size in entries:
        name = path.rsplit("/", 1)[-1].lower()
        if not name.endswith(".gguf") or name.startswith("mmproj") or "-mmproj" in name:
            continue
        groups.setdefault(SPLIT_PART.sub("", path) if SPLIT_PART.search(path) else path, []).append((path, size))
    found = []
    for members in groups.values():
        members.sort()
        first = members[0][0]
        m = QUANT_IN_NAME.search(first.rsplit("/", 1)[-1])
        quant = ((m.group(1) or "") + m.group(2)).upper() if m else ""
        found.append(RepoGguf(first, tuple(p for p, _ in members), sum(n for _, n in members), quant))
    return sorted(found, key=lambda g: (g.size, g.file))


def list_repo_gguf(repo_id: str) -> list[RepoGguf]:
    """The repo's GGUF models, asked of the Hub (one request; raises what huggingface_hub raises)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    tree = HfApi().list_repo_tree(repo_id, recursive=True)
    return gguf_files_of([(f.path, f.size or 0) for f in tree if isinstance(f, RepoFile)])


class RepoListWorker(QObject):
    """Lists a repo's GGUF files off the GUI thread; signals listed(repo id, [RepoGguf]) or failed(message)."""

    listed = Signal(str, list)
    failed = Signal(str)

    def __init__(self, repo_id: str) -> None:
        super().__init__()
        self.repo_id = repo_id

    def run(self) -> None:
        try:
            files = list_repo_gguf(self.repo_id)
        except Exception as e:  # offline, no such repo: the download itself says why, in words
            self.failed.emit(download_error_text(self.repo_id, e))
        else:
            self.listed.emit(self.repo_id, files)


class DownloadWorker(QObject):
    """Downloads one repo; signals progress(done, total, unit), finished(path), failed(message)."""

    progress = Signal(float, float, str)
    finished = Signal(str)
    failed = Signal(str)

    def __init__(self, repo_id: str, cache_dir: str | None = None, gguf: RepoGguf | None = None) -> None:
        """`gguf`: download that one GGUF model's file(s) and finish with its path, not the whole repo."""
        super().__init__()
        self.repo_id = repo_id
        self.cache_dir = cache_dir
        self.gguf = gguf
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

        patterns = list(self.gguf.parts) if self.gguf is not None else None
        try:
            path = snapshot_download(self.repo_id, cache_dir=self.cache_dir, tqdm_class=self._tqdm_class(),
                                     allow_patterns=patterns)
            if self.gguf is not None:
                path = f"{path}/{self.gguf.file}"
        except DownloadCancelled as e:
            self.failed.emit(str(e))
        except Exception as e:  # network, auth, missing repo: report, never crash the GUI
            self.failed.emit(download_error_text(self.repo_id, e))
        else:
            self.finished.emit(str(path))


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def download_error_text(repo_id: str, exc: BaseException) -> str:
    """Why downloading `repo_id` failed, in words a user can act on."""
    from huggingface_hub import errors

    head = f"Could not download {repo_id}: "
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError)):
        offline = hub_offline()
        return head + ("offline mode is on (HF_HUB_OFFLINE), and it is not in the local cache. Unset HF_HUB_OFFLINE "
                       "to download it." if offline else
                       "huggingface.co cannot be reached (is this computer offline, or behind a proxy?), and it is "
                       "not in the local cache. Check the connection, then try again.")
    if isinstance(exc, errors.GatedRepoError):
        return head + ("it is a gated model. Accept its licence on its page at huggingface.co, log in on this "
                       "computer (`hf auth login`, or set HF_TOKEN), then try again.")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return head + ("the Hugging Face Hub has no model by that name (a private one needs you to log in). Check "
                       "the name: it looks like owner/model, e.g. Qwen/Qwen3-8B.")
    if isinstance(exc, errors.RevisionNotFoundError):
        return head + "that revision (branch, tag or commit) does not exist in the repository."
    if isinstance(exc, errors.HFValidationError):
        return head + "that is not a model id. It looks like owner/model, e.g. Qwen/Qwen3-8B."
    if status in (401, 403):
        return head + "the Hub refused access (not logged in, or this account may not read it). Log in with "                       "`hf auth login` or set HF_TOKEN."
    if status == 429:
        return head + "the Hub is limiting requests from this computer. Wait a few minutes, then try again."
    if isinstance(status, int) and status >= 500:
        return head + f"the Hub is having trouble (HTTP {status}). Try again later."
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return head + "the disk is full. Free some space (models take several GiB), then try again; the download "                       "resumes where it stopped."
    if isinstance(exc, PermissionError):
        return head + f"the cache folder cannot be written ({exc.filename or 'permission denied'})."
    if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__ in ("ConnectError", "ConnectTimeout",
                                                                                  "ReadTimeout", "ConnectionError"):
        return head + "huggingface.co did not answer. Check the connection or proxy, then try again; the download "                       "resumes where it stopped."
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    return head + (first_line or "an unexpected error.") + " Try again; the download resumes where it stopped."


class _NullFile:
    def write(self, _s: str) -> None:
        pass

    def flush(self) -> None:
        pass
