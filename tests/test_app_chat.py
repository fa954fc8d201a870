"""Chat: SQLite persistence under PAGEDESK_DATA_DIR, streaming into the view with TTFT and tokens/s,
stop and regenerate, and a clear message when the engine is not running."""
import qt_helpers as helpers

import pytest

from app.chat_panel import NOT_RUNNING, ChatPanel
from app.chat_store import ChatStore
from app.paths import data_dir
from app.supervisor import EngineSupervisor


def test_store_persists_conversations(tmp_path):
    store = ChatStore(tmp_path / "c.db")
    cid = store.new_conversation("First", "be brief")
    store.add_message(cid, "user", "hi")
    mid = store.add_message(cid, "assistant", "hello", "TTFT 5 ms")
    store.close()
    store = ChatStore(tmp_path / "c.db")
    assert [c.title for c in store.conversations()] == ["First"]
    assert [(m.role, m.content, m.stats) for m in store.messages(cid)] == [("user", "hi", ""),
                                                                           ("assistant", "hello", "TTFT 5 ms")]
    store.delete_message(mid)
    store.delete_conversation(cid)
    assert store.conversations() == [] and store.messages(cid) == []


def test_data_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDESK_DATA_DIR", str(tmp_path / "d"))
    assert data_dir() == tmp_path / "d" and (tmp_path / "d").is_dir()


@pytest.fixture
def panel(qtbot, tmp_path):
    p = ChatPanel(ChatStore(tmp_path / "chat.db"))
    qtbot.addWidget(p)
    yield p
    p.client.wait_idle()


def test_not_running_says_so(panel, qtbot):
    panel.input.setPlainText("hello?")
    with qtbot.waitSignal(panel.reply_failed) as failed:
        panel.send_button.click()
    assert failed.args[0] == NOT_RUNNING
    assert "engine is not running" in panel.view.toPlainText()


def test_stream_regenerate_and_persist(panel, qtbot):
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    try:
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            sup.start("/m", {"host": "127.0.0.1", "port": helpers.free_port(), "api_key": "k"})
        panel.set_endpoint(sup.base_url, "k", "fake-model")
        panel.system_prompt.setPlainText("Answer in one word.")
        panel.input.setPlainText("Say hello")
        with qtbot.waitSignal(panel.reply_finished, timeout=10_000) as done:
            panel.send_button.click()
            qtbot.waitUntil(lambda: panel.stop_button.isEnabled(), timeout=2000)
        result = done.args[0]
        assert result.text.startswith("Hello from the fake engine")
        assert result.ttft_s is not None and result.completion_tokens == 6 and result.tokens_per_s > 0
        qtbot.waitUntil(lambda: "TTFT" in panel.view.toPlainText(), timeout=2000)
        assert "print('hi')" in panel.view.toPlainText()  # the fenced code block survived rendering
        stored = panel.store.messages(panel.conversation_id)
        assert [m.role for m in stored] == ["user", "assistant"] and "tokens/s" in stored[1].stats
        assert panel.store.conversation(panel.conversation_id).system_prompt == "Answer in one word."
        assert panel.store.conversation(panel.conversation_id).title == "Say hello"
        with qtbot.waitSignal(panel.reply_finished, timeout=10_000):
            panel.regenerate_button.click()
        assert [m.role for m in panel.store.messages(panel.conversation_id)] == ["user", "assistant"]
    finally:
        sup.shutdown()


def test_stop_ends_the_stream_early(panel, qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_TOKEN_DELAY", "0.3")
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    try:
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            sup.start("/m", {"host": "127.0.0.1", "port": helpers.free_port()})
        panel.set_endpoint(sup.base_url, None, "fake-model")
        panel.input.setPlainText("Say hello slowly")
        with qtbot.waitSignal(panel.client.delta, timeout=5000):
            panel.send_button.click()
        with qtbot.waitSignal(panel.reply_finished, timeout=5000) as done:
            panel.stop_button.click()
        assert done.args[0].finish_reason == "stopped" and done.args[0].completion_tokens < 6
        assert panel.send_button.isEnabled() and not panel.stop_button.isEnabled()
        assert panel.store.messages(panel.conversation_id)[-1].role == "assistant"  # partial reply kept
    finally:
        sup.shutdown()
