"""Chat: SQLite persistence under PAGEDESK_DATA_DIR, streaming into the view with TTFT and tokens/s (first to
last token, none for a reply of a few tokens), the context meter, stop and regenerate, undo of a delete back
in its place, and a clear message when the engine is not running."""
import qt_helpers as helpers

import json

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
        assert result.ttft_s is not None and result.completion_tokens == 6
        assert result.tokens_per_s is None  # six tokens: too few for a rate worth showing
        qtbot.waitUntil(lambda: "TTFT" in panel.view.toPlainText(), timeout=2000)
        assert panel.context_meter.isVisibleTo(panel) and panel.context_meter.format() == "Context 11 / 4,096 tokens"
        assert "print('hi')" in panel.view.toPlainText()  # the fenced code block survived rendering
        stored = panel.store.messages(panel.conversation_id)
        assert [m.role for m in stored] == ["user", "assistant"] and "TTFT" in stored[1].stats
        assert "tokens/s" not in stored[1].stats
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


def test_the_rate_runs_from_the_first_token_to_the_last():
    from app.chat_client import ChatResult
    burst = ChatResult(ttft_s=0.100, last_token_s=0.1000005, completion_tokens=15, elapsed_s=0.2)
    assert burst.tokens_per_s == pytest.approx(14 / 0.0000005)  # honest: what the stream really did
    steady = ChatResult(ttft_s=0.1, last_token_s=1.1, completion_tokens=21, elapsed_s=5.0)  # 4 s idle after
    assert steady.tokens_per_s == pytest.approx(20.0) and "20.0 tokens/s" in steady.summary()
    assert ChatResult(ttft_s=0.1, last_token_s=0.1, completion_tokens=30).tokens_per_s is None  # no span
    assert ChatResult(ttft_s=0.1, last_token_s=0.5, completion_tokens=5).tokens_per_s is None  # too few


def test_undo_delete_puts_the_chat_back_where_it_was(panel):
    store = panel.store
    ids = []
    for title in ("oldest", "middle", "newest"):
        ids.append(store.new_conversation(title, "sys"))
        store.add_message(ids[-1], "user", f"hi {title}")
    panel.conversation_id = None
    panel._load_conversations()
    middle = next(i for i in range(panel.conversation_list.count())
                  if panel.conversation_list.item(i).text() == "middle")
    width = panel.conversation_list.parentWidget().width()
    panel.conversation_list.setCurrentRow(middle)
    panel.delete_conversation()
    assert "middle" not in [c.title for c in store.conversations()]
    panel.undo_delete()
    titles = [c.title for c in store.conversations()]
    assert titles.index("middle") == titles.index("newest") + 1 == titles.index("oldest") - 1
    assert [m.content for m in store.messages(panel.conversation_id)] == ["hi middle"]
    assert panel.conversation_list.parentWidget().width() == width


def test_a_reply_names_its_model_and_a_new_chat_keeps_the_pick(panel, qtbot, tmp_path, monkeypatch):
    """Issue 38, item 3: each reply says which model wrote it (stored with it), "New chat" keeps the model picked
    above the chat, and the picker leaves out a model whose load failed."""
    from app.loaded_models import ModelRow

    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_SERVE_REQUEST_LOG", str(log))
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    try:
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            sup.start("/m/chat", {"host": "127.0.0.1", "port": helpers.free_port()})
        panel.set_endpoint(sup.base_url, None, "chat")
        panel.set_models([ModelRow("chat", "loaded", "CPU", 1, 64, "none"),
                          ModelRow("coder", "unloaded", "", 0, 64, "none"),
                          ModelRow("broken", "failed", "", 0, 64, "none", "engine exited with code 2", True, False)])
        combo = panel.model_choice.combo
        assert [combo.itemText(i) for i in range(combo.count())] == ["chat", "coder (loads on send)"]
        combo.setCurrentIndex(1)
        panel.new_button.click()
        assert panel.model == "coder" and panel.model_choice.current() == "coder"
        assert not panel.regenerate_button.isEnabled()  # an empty chat has nothing to answer again
        panel.input.setPlainText("Say hello")
        with qtbot.waitSignal(panel.reply_finished, timeout=10_000) as done:
            panel.send_button.click()
        assert done.args[0].model == "coder" and json.loads(log.read_text().splitlines()[-1])["model"] == "coder"
        assert "Assistant · coder" in panel.view.toPlainText()
        assert panel.store.messages(panel.conversation_id)[-1].model == "coder"
        assert panel.regenerate_button.isEnabled()
        panel.conversation_id = None
        panel._load_conversations()  # reopened: the label comes back from the store
        assert "Assistant · coder" in panel.view.toPlainText()
    finally:
        sup.shutdown()


def test_regenerate_replaces_the_reply_and_its_note_once(panel, qtbot, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_MAX_MODEL_LEN", "60")  # Max tokens 512 is lowered: a note before each reply
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    try:
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            sup.start("/m", {"host": "127.0.0.1", "port": helpers.free_port()})
        panel.set_endpoint(sup.base_url, None, "fake-model")
        panel.input.setPlainText("Say hello")
        with qtbot.waitSignal(panel.reply_finished, timeout=10_000):
            panel.send_button.click()
        with qtbot.waitSignal(panel.reply_finished, timeout=10_000):
            panel.regenerate_button.click()
        assert [m.role for m in panel.store.messages(panel.conversation_id)] == ["user", "note", "assistant"]
        assert panel.view.toPlainText().count("Max tokens lowered") == 1
    finally:
        sup.shutdown()


def test_only_a_reply_being_written_shows_an_ellipsis(qtbot):
    from widgets.chat_view import ChatMessage, ChatView

    view = ChatView()
    qtbot.addWidget(view)
    view.set_messages([ChatMessage("assistant", "", "no tokens · finish: stopped", model="m")])
    assert "…" not in view.toPlainText() and "(no text)" in view.toPlainText()
    view.add_message(ChatMessage("assistant", "", pending=True))
    assert view.toPlainText().rstrip().endswith("…")
