"""Issue 36 in the app: the Monitor shows the CPU-RAM tier beside the block map and says when the engine sleeps;
Loaded models offers Sleep and Wake (the router's routes, or a one-engine server's own, whose /is_sleeping it reads);
the tray offers them while a model serves; the planner line counts the tier's host RAM."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)
import pytest

from app.capacity import capacity_line
from app.demo_data import demo_states
from app.engine_state import parse_state
from app.loaded_models import LoadedModelsPanel
from app.monitor_panel import MonitorPanel
from app.settings import default_values

TIER = {"num_blocks": 1000, "blocks_held": 250, "num_state_slots": 0, "states_held": 0, "capacity_bytes": 2 ** 30,
        "hit_tokens": 4096, "miss_tokens": 16, "bytes_stored": 3 * 2 ** 20, "bytes_loaded": 2 ** 20,
        "blocks_stored": 12, "blocks_loaded": 4, "loads_in_flight": 1}


def test_the_monitor_shows_the_tier_and_a_sleeping_engine(qtbot):
    monitor = MonitorPanel()
    qtbot.addWidget(monitor)
    _, state = demo_states(num_samples=1)[0]
    monitor.on_state(state, now=0.0)
    assert not monitor.host_tier.isVisibleTo(monitor) and "asleep" not in monitor.headline.text()
    parsed = parse_state({"num_blocks": 0, "blocks": "", "kv_offload": TIER, "sleep_level": 1})
    assert parsed.kv_offload.blocks_held == 250 and parsed.sleep_level == 1
    state.kv_offload, state.sleep_level = parsed.kv_offload, 1
    monitor.on_state(state, now=1.0)
    assert monitor.host_tier.isVisibleTo(monitor) and monitor.host_tier.bar.text() == "25.0% used"
    details = monitor.host_tier.details.text()
    assert "250 of 1,000 blocks" in details and "restored 4,096 prompt tokens" in details and "1 request" in details
    assert "asleep" in monitor.headline.text() and "CPU RAM" in monitor.headline.text()


class FakeServer(BaseHTTPRequestHandler):
    """A router (`managed`) or a one-engine server, each with sleep mode."""

    managed = True
    asleep = False
    posts: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _card(self) -> dict:
        if not self.managed:
            return {"id": "solo", "max_model_len": 256}
        return {"id": "chat", "loaded": True, "state": "sleeping" if self.asleep else "loaded", "engines": []}

    def do_GET(self) -> None:
        if self.path == "/is_sleeping":
            return self._reply({"is_sleeping": FakeServer.asleep})
        self._reply({"object": "list", "data": [self._card()]})

    def do_POST(self) -> None:
        FakeServer.posts.append(self.path.split("?")[0])
        FakeServer.asleep = self.path.split("?")[0].endswith("/sleep")
        self._reply(self._card())


@pytest.fixture
def server():
    FakeServer.asleep, FakeServer.posts = False, []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.mark.parametrize("managed", [True, False])
def test_sleep_and_wake_from_the_loaded_models_tab(qtbot, server, managed):
    FakeServer.managed = managed
    panel = LoadedModelsPanel()
    qtbot.addWidget(panel)
    panel.set_endpoint(server)
    qtbot.waitUntil(lambda: panel.table.rowCount() == 1, timeout=5000)
    panel.table.selectRow(0)
    assert panel.sleep_button.isEnabled() and not panel.wake_button.isEnabled()
    panel.sleep_button.click()
    qtbot.waitUntil(lambda: panel.table.item(0, 1).text() == "sleeping", timeout=5000)
    assert panel.wake_button.isEnabled() and not panel.sleep_button.isEnabled() and panel.rows[0].loaded
    assert "asleep" in panel.status.text()
    panel.wake_button.click()
    qtbot.waitUntil(lambda: panel.table.item(0, 1).text() == "loaded", timeout=5000)
    name = "chat" if managed else None
    assert FakeServer.posts == ([f"/v1/models/{name}/sleep", f"/v1/models/{name}/wake_up"] if managed
                                else ["/sleep", "/wake_up"])
    panel.set_endpoint(None)


def test_the_planner_line_counts_the_tiers_host_ram(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    values = {**default_values(0), "max_num_seqs": 4}
    without = capacity_line(config, values, [])
    line = capacity_line(config, {**values, "kv_offloading_size": 0.5}, [])
    assert "CPU-RAM tier" not in without and line.startswith(without)
    assert "CPU-RAM tier 512.0 MiB: 65,536 blocks (1,048,576 tokens)" in line and "blocks (" in line and line.endswith("of host RAM")


def test_the_tray_offers_sleep_and_wake_only_while_a_model_serves(qtbot):
    from PySide6.QtGui import QAction
    from PySide6.QtWidgets import QWidget

    from app.tray import Tray
    window = QWidget()
    qtbot.addWidget(window)
    for name, text in (("start_action", "Start"), ("stop_action", "Stop"), ("quit_action", "Quit"),
                       ("sleep_action", "Sleep (free the GPU)"), ("wake_action", "Wake")):
        setattr(window, name, QAction(text, window))
    tray = Tray(window)
    labels = lambda: [a.text() for a in tray.menu.actions() if a.text()]  # noqa: E731
    assert "Wake" not in labels()
    tray.offer_sleep(True)
    tray.offer_sleep(True)  # once only
    assert labels()[-4:] == ["Sleep (free the GPU)", "Wake", "Open PagedDesk", "Quit"]
    tray.offer_sleep(False)
    assert "Sleep (free the GPU)" not in labels()


def test_the_served_set_may_sleep_idle_models(qtbot, tmp_path):
    from PySide6.QtCore import QSettings

    from app.served_set import ServedSet, load_served_set, save_served_set
    from app.served_set_panel import ServedSetPanel
    served = ServedSet(["/models/coder"], 30, False, True)
    assert served.router_argv("chat", 0)[-4:] == ["--model-ttl", "1800", "--model-ttl-action", "sleep"]
    assert "--model-ttl-action" not in ServedSet(["/models/coder"], 30).router_argv("chat", 0)
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)  # not the app's own
    save_served_set(settings, served)
    assert load_served_set(settings).ttl_sleeps
    panel = ServedSetPanel(ServedSet(["/models/coder"]))
    qtbot.addWidget(panel)
    assert not panel.ttl_sleeps.isEnabled()  # no idle time: nothing to sleep on
    with qtbot.waitSignal(panel.changed):
        panel.ttl.setValue(10)
    assert panel.ttl_sleeps.isEnabled()
    with qtbot.waitSignal(panel.changed) as changed:
        panel.ttl_sleeps.setChecked(True)
    assert changed.args[0].ttl_sleeps and "--model-ttl-action" in changed.args[0].router_argv("chat", 0)
