"""Endpoint panel: base URL, key and snippets that a person can paste and run."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

from PySide6.QtGui import QGuiApplication

from app.endpoint_panel import EndpointPanel, curl_snippet, python_snippet


def test_snippets_carry_url_key_and_model(qtbot):
    panel = EndpointPanel()
    qtbot.addWidget(panel)
    panel.set_endpoint("http://127.0.0.1:8001", "sk-abc", "qwen", running=True)
    assert panel.base_url.text() == "http://127.0.0.1:8001/v1"
    assert "Authorization: Bearer sk-abc" in panel.curl.toPlainText()
    assert "http://127.0.0.1:8001/v1/chat/completions" in panel.curl.toPlainText()
    py = panel.python.toPlainText()
    assert "base_url='http://127.0.0.1:8001/v1'" in py and "api_key='sk-abc'" in py and "model='qwen'" in py
    compile(py, "snippet", "exec")
    assert "READY" in panel.state.text()
    assert "Authorization" not in curl_snippet("http://h:1", None, "m")
    assert "api_key='EMPTY'" in python_snippet("http://h:1", None, "m")
    copy_buttons = [b for b in panel.findChildren(type(panel.show_key)) if b.text() == "Copy"]
    copy_buttons[0].click()
    assert QGuiApplication.clipboard().text() == "http://127.0.0.1:8001/v1"
