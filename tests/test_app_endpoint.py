"""Endpoint panel: base URL, key and snippets that a person can paste and run."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

from PySide6.QtGui import QGuiApplication

from app.endpoint_panel import EndpointPanel, agents_snippet, curl_snippet, python_snippet


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


def test_agent_snippets_wire_each_cli_to_the_endpoint(qtbot):
    panel = EndpointPanel()
    qtbot.addWidget(panel)
    panel.set_endpoint("http://127.0.0.1:8001", "sk-abc", "qwen", running=True, context_length=65536)
    text = panel.agents.toPlainText()
    for agent in ("claude", "codex", "opencode"):
        assert f"pagedesk launch {agent} --url http://127.0.0.1:8001" in text
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:8001 ANTHROPIC_AUTH_TOKEN=sk-abc" in text
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS=65536" in text and "ANTHROPIC_DEFAULT_HAIKU_MODEL=qwen" in text
    assert 'base_url="http://127.0.0.1:8001/v1", wire_api="responses"' in text and "PAGEDESK_API_KEY=sk-abc" in text
    assert "OPENCODE_CONFIG_CONTENT=" in text and '"pagedesk/qwen"' in text
    assert "pagedesk launch claude" in agents_snippet("http://h:1", None, "m")
