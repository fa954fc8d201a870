"""The Doctor tab runs pagedesk-doctor as a subprocess and shows its rows; Re-run runs it again; a doctor
that cannot report says so instead of leaving an empty table."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

import sys

from app.doctor_panel import DoctorPanel


def test_doctor_page_shows_the_no_gpu_row_and_reruns(qtbot):
    panel = DoctorPanel()
    qtbot.addWidget(panel)
    with qtbot.waitSignal(panel.finished, timeout=120_000) as done:
        panel.show()  # first show starts the doctor
    rows = done.args[0]
    assert [r.check for r in rows if "GPU" in r.check] == ["NVIDIA GPU"]
    cells = {panel.table.item(i, 0).text(): panel.table.item(i, 1).text() for i in range(panel.table.rowCount())}
    assert cells["NVIDIA GPU"] == "WARN" and cells["torch"] == "PASS"
    assert panel.status.text().endswith("0 failed") and panel.rerun.isEnabled()
    panel.command = [sys.executable, "-c", "import json; print(json.dumps({'rows': [{'check': 'GPU 0', "
                     "'status': 'fail', 'detail': 'gone', 'remedy': 'reseat it'}], 'exit_code': 1}))"]
    with qtbot.waitSignal(panel.finished, timeout=60_000):
        panel.rerun.click()
    assert panel.table.rowCount() == 1 and panel.table.item(0, 3).text() == "reseat it"
    assert panel.status.text() == "0 passed, 0 warnings, 1 failed"


def test_a_doctor_that_crashes_is_reported(qtbot):
    panel = DoctorPanel([sys.executable, "-c", "import sys; sys.exit('ImportError: no module named torch')"])
    qtbot.addWidget(panel)
    with qtbot.waitSignal(panel.finished, timeout=60_000) as done:
        panel.run()
    assert done.args[0] == [] and panel.table.rowCount() == 0
    assert panel.status.text() == "The doctor stopped without a report: ImportError: no module named torch"
