"""The Benchmark tab against a real pagedesk server (tiny model): a bounded run goes off the GUI thread,
the live plots get samples, the result lands in SQLite and the past-runs table, two runs overlay; a
dead endpoint ends in a message, not a hang."""
from __future__ import annotations

import pytest

from server_harness import start_server, token_by_token
from app.bench_store import BenchStore
from app.benchmark_panel import BenchmarkPanel


@pytest.fixture(scope="module")
def server(llama_dir):
    with token_by_token():  # the inter-token latencies below need one chunk per token, however fast the engine
        srv = start_server(llama_dir, num_gpu_blocks_override=256, max_num_seqs=16)
        yield srv
        srv.stop()


@pytest.fixture
def panel(qtbot, tmp_path):
    store = BenchStore(tmp_path / "benchmarks.sqlite3")
    widget = BenchmarkPanel(store)
    qtbot.addWidget(widget)
    yield widget
    widget.runner.wait()
    store.close()


def run_once(panel, qtbot, label: str) -> None:
    qtbot.waitUntil(panel.run_button.isEnabled, timeout=5000)  # the previous run's thread has ended
    panel.label.setText(label)
    with qtbot.waitSignal(panel.runner.finished, timeout=60000) as blocker:
        panel.run_button.click()
        assert panel.stop_button.isEnabled() and not panel.run_button.isEnabled()
    assert blocker.args[0].summary.errors == 0, blocker.args[0].summary.first_errors


def test_runs_are_plotted_stored_and_overlaid(panel, qtbot, server):
    assert not panel.run_button.isEnabled()  # no engine yet
    panel.set_endpoint(server.url, max_model_len=256)
    panel.num_requests.setValue(4)
    panel.rate.setValue(0)  # all at once
    panel.prompt_mean.setValue(12)
    panel.output_len.setValue(4)
    run_once(panel, qtbot, "burst")
    panel.endpoint_kind.setCurrentText("chat")
    panel.concurrency.setValue(2)
    run_once(panel, qtbot, "chat c2")
    assert len(panel.throughput_plot.buffer) >= 1 and len(panel.latency_plot.buffer) >= 1
    runs = panel.store.runs()
    assert [r.label for r in runs] == ["chat c2", "burst"]
    assert runs[0].config["max_concurrency"] == 2 and runs[0].summary["output_tokens"] == 16
    assert panel.table.rowCount() == 2 and panel.table.item(0, 0).text() == "chat c2"
    assert panel.table.item(0, 1).text() == f"{runs[0].summary['output_throughput']:.1f}"  # key figures first
    # The live axes follow the run: its whole length is in view, however short it was.
    plot = panel.throughput_plot
    plot.append(*plot.buffer.arrays()[0][-1:], plot.buffer.arrays()[1][-1])  # a sample to draw, drawn now
    plot.redraw()
    t = plot.buffer.arrays()[0]
    (x_low, x_high), _ = plot.viewRange()
    assert x_low <= 0.0 and x_high <= max(1.0, float(t[-1] - t[0])) * 1.1
    panel.table.selectAll()
    assert len(panel.selected_runs()) == 2
    assert len(panel.overlay.getPlotItem().listDataItems()) == 4  # ITL and TTFT of each run
    assert len(panel.store.curves(runs[1].id)["ttft_ms"]) == 99
    qtbot.waitUntil(lambda: panel.run_button.isEnabled(), timeout=5000)


def test_unreachable_endpoint_reports_failure(panel, qtbot):
    from qt_helpers import free_port
    panel.set_endpoint(f"http://127.0.0.1:{free_port()}")
    panel.num_requests.setValue(2)
    with qtbot.waitSignal(panel.runner.failed, timeout=30000):
        panel.run_button.click()
    assert "failed" in panel.status.text() and panel.store.runs() == []
    qtbot.waitUntil(lambda: panel.run_button.isEnabled(), timeout=5000)
