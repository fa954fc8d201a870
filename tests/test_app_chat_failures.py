"""Chat when things go wrong, against the fake server: the server's own message for an HTTP error or
an in-band stream error, "the engine stopped while answering" for a cut stream (never a Python
exception name); failed replies persisted and left out of the next request's history; deleting a
chat with undo, disabled while generating; new chats with the default system prompt; sampling
settings that survive a relaunch."""
import qt_helpers as helpers

import subprocess
import time

import httpx
import pytest
from PySide6.QtCore import QSettings

from app.chat_client import STOPPED_WHILE_ANSWERING
from app.chat_panel import DEFAULT_SYSTEM_PROMPT, ChatPanel
from app.chat_store import ChatStore


@pytest.fixture(scope="module")
def base_url():
    port = helpers.free_port()
    env = {"FAKE_SERVE_TOKEN_DELAY": "0.05"}
    proc = subprocess.Popen([*helpers.FAKE_SERVE_COMMAND, "--port", str(port)], stdout=subprocess.DEVNULL,
                            env={**__import__("os").environ, **env})
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture
def panel(qtbot, tmp_path):
    p = ChatPanel(ChatStore(tmp_path / "chat.db"), QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(p)
    yield p
    p.client.wait_idle()


def ask(panel, qtbot, base_url, model, text="hello"):
    panel.set_endpoint(base_url, None, model)
    panel.input.setPlainText(text)
    with qtbot.waitSignal(panel.reply_failed, timeout=10_000) as failed:
        panel.send_button.click()
    return failed.args[0]


@pytest.mark.parametrize("model, expected", [
    ("fail-400", "The engine refused the request: max_tokens must be at least 1, got 0"),
    ("error-midway", "The engine failed while answering: the engine died while serving"),
    ("die-midway", STOPPED_WHILE_ANSWERING)])
def test_errors_read_as_sentences(panel, qtbot, base_url, model, expected):
    message = ask(panel, qtbot, base_url, model)
    assert message == expected
    assert "Error" not in message and "HTTP 400" not in message


def test_failed_reply_is_kept_and_left_out_of_the_next_history(panel, qtbot, base_url):
    ask(panel, qtbot, base_url, "fail-400", "refused question")
    ask(panel, qtbot, base_url, "die-midway", "cut question")
    cid = panel.conversation_id
    stored = panel.store.messages(cid)
    assert [m.role for m in stored] == ["user", "error", "user", "assistant", "error"]
    assert stored[3].stats == "incomplete" and stored[3].content  # the partial reply, marked as such
    panel.set_endpoint(base_url, None, "fake-model")
    panel.input.setPlainText("third question")
    with qtbot.waitSignal(panel.reply_finished, timeout=10_000):
        panel.send_button.click()
    history = panel._history()
    assert [m["content"] for m in history if m["role"] == "user"] == ["cut question", "third question"]
    roles = [m["role"] for m in history]
    assert all(not (a == b == "user") for a, b in zip(roles, roles[1:]))  # never two user turns in a row
    reopened = ChatPanel(panel.store)
    qtbot.addWidget(reopened)
    text = reopened.view.toPlainText()
    assert "refused the request" in text and "stopped while answering" in text


def test_delete_has_undo_and_is_disabled_while_generating(panel, qtbot, base_url):
    panel.set_endpoint(base_url, None, "fake-model")
    panel.input.setPlainText("keep me")
    with qtbot.waitSignal(panel.reply_finished, timeout=10_000):
        panel.send_button.click()
        qtbot.waitUntil(lambda: panel.generating, timeout=2000)
        assert not panel.delete_button.isEnabled() and not panel.new_button.isEnabled()
    assert panel.delete_button.isEnabled()
    panel.delete_button.click()
    assert "keep me" not in [c.title for c in panel.store.conversations()] and panel.undo_button.isVisibleTo(panel)
    panel.undo_button.click()
    restored = [c for c in panel.store.conversations() if c.title == "keep me"]
    assert len(restored) == 1 and [m.role for m in panel.store.messages(restored[0].id)] == ["user", "assistant"]
    assert not panel.undo_button.isVisibleTo(panel)


def test_new_chat_starts_from_the_default_system_prompt(panel):
    panel.system_prompt.setPlainText("You are a pirate.")
    panel.new_conversation()
    assert panel.system_prompt.toPlainText() == DEFAULT_SYSTEM_PROMPT
    assert panel.store.conversation(panel.conversation_id).system_prompt == DEFAULT_SYSTEM_PROMPT


def test_sampling_settings_survive_a_relaunch(qtbot, tmp_path):
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    first = ChatPanel(ChatStore(tmp_path / "a.db"), settings)
    qtbot.addWidget(first)
    first.temperature.setValue(0.2)
    first.max_tokens.setValue(77)
    settings.sync()
    second = ChatPanel(ChatStore(tmp_path / "b.db"), QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(second)
    assert second.temperature.value() == pytest.approx(0.2) and second.max_tokens.value() == 77
