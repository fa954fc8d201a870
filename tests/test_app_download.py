"""Hub download worker: progress arrives as signals from the tqdm class, Cancel stops it at the next
update, and a failure (here: offline) becomes a message instead of an exception."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

import pytest

from app.hf_cache import DownloadCancelled, DownloadWorker


def test_tqdm_class_reports_progress_and_cancels():
    worker = DownloadWorker("org/model")
    seen = []
    worker.progress.connect(lambda done, total, unit: seen.append((done, total, unit)))
    bar = worker._tqdm_class()(total=1000, unit="B")
    bar.update(250)
    bar.update(250)
    assert seen[-1] == (500.0, 1000.0, "B")
    worker.cancel()
    with pytest.raises(DownloadCancelled):
        bar.update(1)
    bar.close()


def test_offline_download_fails_with_a_message(qtbot, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    worker = DownloadWorker("pagedesk/does-not-exist", cache_dir=str(tmp_path))
    with qtbot.waitSignal(worker.failed, timeout=10_000) as failed:
        worker.run()
    text = failed.args[0]
    assert text.startswith("Could not download pagedesk/does-not-exist: offline mode is on (HF_HUB_OFFLINE)")
    assert "Error" not in text  # in words, never an exception's class name


def test_picker_download_reports_failure_and_resets(qtbot, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from app.model_picker import ModelPicker

    from app.model_library import ModelLibrary

    picker = ModelPicker()
    library = ModelLibrary()
    qtbot.addWidget(picker)
    qtbot.addWidget(library)
    picker.download_progress.connect(library.show_download)
    picker.download_ended.connect(library.end_download)
    picker.repo_edit.setText("pagedesk/not-cached")
    with qtbot.waitSignal(picker.download_ended, timeout=10_000) as ended:
        picker.download_button.click()
        assert not picker.download_button.isEnabled() and picker.cancel_button.isEnabled()
        rows = [library.table.item(r, 0).text() for r in range(library.table.rowCount())]
        assert "pagedesk/not-cached" in rows  # the download is a row of the library while it runs
    assert ended.args[0] == "pagedesk/not-cached" and "offline mode is on" in ended.args[1]
    assert "Could not download" in picker.details.text() and not picker.cancel_button.isEnabled()
    assert picker.download_button.isEnabled() and "pagedesk/not-cached" not in library.downloads


def test_download_errors_are_told_in_words():
    import errno

    import httpx
    from huggingface_hub import errors

    from app.hf_cache import download_error_text

    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/x/y"))
    cases = {
        errors.GatedRepoError("gated", response=response): "gated model",
        errors.RepositoryNotFoundError("nope", response=response): "no model by that name",
        errors.HFValidationError("Repo id must be in the form"): "not a model id",
        errors.HfHubHTTPError("limited", response=httpx.Response(429, request=response.request)): "limiting",
        errors.HfHubHTTPError("down", response=httpx.Response(503, request=response.request)): "HTTP 503",
        errors.HfHubHTTPError("no", response=httpx.Response(401, request=response.request)): "refused access",
        OSError(errno.ENOSPC, "No space left on device"): "disk is full",
        httpx.ConnectError("[Errno -3] Temporary failure in name resolution"): "did not answer",
    }
    for exc, words in cases.items():
        text = download_error_text("x/y", exc)
        assert text.startswith("Could not download x/y: ") and words in text, (exc, text)
        assert type(exc).__name__ not in text
