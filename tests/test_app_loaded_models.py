"""The Loaded models list and the Chat tab's picker against a stand-in router (stdlib HTTP, no engine):
rows from /v1/models, load and unload through the buttons with the key, the picker marking unloaded models."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)
import pytest

from app.loaded_models import ChatModelChoice, LoadedModelsPanel, model_rows

KEY = "sk-test"


class FakeRouter(BaseHTTPRequestHandler):
    models = {}

    def log_message(self, *args) -> None:
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _card(self, name: str) -> dict:
        loaded = self.models[name]
        engines = [{"index": 0, "state": "ready", "devices": [0], "memory_bytes": 3 * 1024 ** 3}] if loaded else []
        return {"id": name, "loaded": loaded, "state": "loaded" if loaded else "unloaded", "max_model_len": 4096,
                "quantization": None, "engines": engines}

    def do_GET(self) -> None:
        if self.headers.get("authorization") != f"Bearer {KEY}":
            return self._reply(401, {"error": {"message": "key"}})
        self._reply(200, {"object": "list", "data": [self._card(n) for n in self.models]})

    def do_POST(self) -> None:
        if self.headers.get("authorization") != f"Bearer {KEY}":
            return self._reply(401, {"error": {"message": "key"}})
        _, _, _, name, action = self.path.split("/")
        if name not in self.models:
            return self._reply(404, {"error": {"message": f"The model `{name}` does not exist"}})
        self.models[name] = action == "load"
        self._reply(200, self._card(name))


@pytest.fixture
def router():
    FakeRouter.models = {"chat": True, "code": False}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRouter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_model_rows_from_router_and_single_engine_lists():
    rows = model_rows({"data": [{"id": "a", "loaded": True, "state": "loaded", "max_model_len": 8,
                                 "engines": [{"devices": [0, 1], "memory_bytes": 5}, {"devices": "cpu",
                                                                                     "cpu_cores": [2, 3]}]},
                                {"id": "b", "loaded": False, "state": "unloaded", "engines": []}]})
    assert rows[0].where == "cuda:0 + cuda:1 | CPU cores 2,3" and rows[0].memory_bytes == 5 and rows[0].loaded
    assert not rows[1].loaded and rows[1].where == ""
    single = model_rows({"data": [{"id": "tiny", "max_model_len": 256}]})  # today's one-engine server
    assert single[0].loaded and single[0].context == 256 and not single[0].managed and rows[0].managed


def test_list_load_unload_and_chat_picker(qtbot, router):
    panel = LoadedModelsPanel()
    picker = ChatModelChoice()
    qtbot.addWidget(panel)
    qtbot.addWidget(picker)
    panel.models_listed.connect(picker.set_rows)
    panel.set_endpoint(router, KEY)
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2, timeout=5000)
    assert [panel.table.item(i, 1).text() for i in range(2)] == ["loaded", "unloaded"]
    assert panel.table.item(0, 2).text() == "cuda:0" and "GiB" in panel.table.item(0, 3).text()
    assert [picker.combo.itemText(i) for i in range(2)] == ["chat", "code (loads on send)"]
    picked = []
    picker.model_picked.connect(picked.append)
    picker.combo.setCurrentIndex(1)
    assert picked == ["code"] and "Loading code on first use" in picker.progress_line()
    panel.table.selectRow(1)
    panel.load_button.click()
    assert panel.table.item(1, 1).text() == "loading…"
    qtbot.waitUntil(lambda: panel.table.item(1, 1).text() == "loaded", timeout=5000)
    assert FakeRouter.models["code"] and picker.progress_line() == "Generating…"
    panel.table.selectRow(0)
    panel.unload_button.click()
    qtbot.waitUntil(lambda: panel.table.item(0, 1).text() == "unloaded", timeout=5000)
    assert "chat: unloaded" in panel.status.text()
    panel.set_endpoint(None)
    assert panel.table.rowCount() == 0 and not panel.timer.isActive()


def test_a_failed_load_says_why(qtbot, router):
    panel = LoadedModelsPanel()
    qtbot.addWidget(panel)
    panel.set_endpoint(router, KEY)
    qtbot.waitUntil(lambda: panel.table.rowCount() == 2, timeout=5000)
    panel.act("load", "gone")
    qtbot.waitUntil(lambda: "failed" in panel.status.text(), timeout=5000)
    assert "does not exist" in panel.status.text()


def test_a_failed_model_is_named_and_can_be_removed_from_the_served_set(qtbot):
    """Issue 34: a model whose folder is broken is served as failed beside the others; the tab says why and offers
    to remove it from the served set."""
    from app.served_set import ServedSet
    from app.served_set_panel import ServedSetPanel

    rows = model_rows({"data": [{"id": "chat", "loaded": True, "state": "loaded", "engines": []},
                                {"id": "bad", "loaded": False, "state": "failed", "engines": [],
                                 "error": "model bad: cannot read config.json"}]})
    assert rows[1].state == "failed" and rows[1].error == "model bad: cannot read config.json"
    panel = LoadedModelsPanel()
    qtbot.addWidget(panel)
    panel._show(rows)
    panel.table.selectRow(0)
    assert not panel.remove_button.isVisibleTo(panel)
    panel.table.selectRow(1)
    assert panel.remove_button.isVisibleTo(panel) and "cannot read config.json" in panel.status.text()
    served = ServedSetPanel(ServedSet(["/models/coder", "/models/bad"]))
    qtbot.addWidget(served)
    panel.remove_requested.connect(lambda name: served.remove_named(name, "chat"))
    with qtbot.waitSignal(served.changed):
        panel.remove_button.click()
    assert served.served.alongside == ["/models/coder"]
    assert not served.remove_named("chat", "chat")  # the chosen model is not served "alongside"
