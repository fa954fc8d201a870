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
    assert "pagedesk/does-not-exist" in failed.args[0] and "failed" in failed.args[0]


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
    assert ended.args[0] == "pagedesk/not-cached" and "failed" in ended.args[1]
    assert "failed" in picker.details.text() and not picker.cancel_button.isEnabled()
    assert picker.download_button.isEnabled() and "pagedesk/not-cached" not in library.downloads
