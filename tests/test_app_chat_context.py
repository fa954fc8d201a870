"""Chats never hit the context wall: the prompt is counted through the server's /tokenize, Max tokens is
lowered to what is left, and when even that is too little the oldest turns are left out (never the system
prompt), each change said in a note in the chat. Unit tests of app/context_fit.py with a word counter, then
ten turns on a 60-token context through the fake server: every send succeeds and the trim is visible."""
import qt_helpers as helpers

import json

import pytest

from app.chat_panel import ChatPanel
from app.chat_store import ChatStore
from app.context_fit import ContextFull, fit_to_context
from app.supervisor import EngineSupervisor


def counter(limit):
    calls = []

    def count(messages):
        calls.append(len(messages))
        return sum(len(m["content"].split()) for m in messages), limit
    count.calls = calls
    return count


def chat(*contents):
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return [{"role": role, "content": text} for role, text in zip(roles, contents)]


def test_a_fitting_request_is_sent_unchanged():
    messages = chat("sys", "one two", "three", "four")
    fit = fit_to_context(messages, 10, counter(100))
    assert fit.messages == messages and fit.max_tokens == 10 and fit.note() == ""


def test_max_tokens_is_lowered_to_what_is_left():
    messages = chat("sys", "a " * 40, "b " * 20, "c " * 5)  # 66 words
    fit = fit_to_context(messages, 512, counter(100))
    assert fit.messages == messages and fit.max_tokens == 34 and fit.dropped == 0
    assert fit.note() == "Max tokens lowered from 512 to 34 for this reply: the prompt uses 66 of 100 tokens."


def test_oldest_turns_are_dropped_keeping_the_system_prompt_and_a_user_first():
    messages = chat("be brief", "a " * 40, "b " * 30, "c " * 10, "d " * 5, "newest question")
    count = counter(100)
    fit = fit_to_context(messages, 512, count, min_reply=40)
    assert fit.messages[0] == messages[0] and fit.messages[-1] == messages[-1]
    assert fit.messages == [messages[0], *messages[3:]] and fit.dropped == 2  # a user turn and its reply
    assert fit.messages[1]["role"] == "user" and fit.max_tokens == 100 - 19
    assert "Left out the 2 oldest messages" in fit.note() and "system prompt is kept" in fit.note()
    assert len(count.calls) <= len(messages) + 1


def test_a_message_that_alone_fills_the_context_is_refused_in_words():
    with pytest.raises(ContextFull, match="This message is 101 tokens .* context holds 100"):
        fit_to_context(chat("sys", "old", "reply", "x " * 100), 16, counter(100))


def test_no_count_sends_unchanged():
    messages = chat("sys", "hi")
    fit = fit_to_context(messages, 512, lambda _m: None)
    assert fit.messages == messages and fit.max_tokens == 512


def test_ten_turns_on_a_tiny_context_all_succeed_and_the_trim_is_visible(qtbot, tmp_path, monkeypatch):
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_SERVE_MAX_MODEL_LEN", "60")
    monkeypatch.setenv("FAKE_SERVE_REQUEST_LOG", str(log))
    monkeypatch.setenv("FAKE_SERVE_TOKEN_DELAY", "0")
    sup = EngineSupervisor(command=helpers.FAKE_SERVE_COMMAND, grace_s=1.0)
    panel = ChatPanel(ChatStore(tmp_path / "chat.db"))
    qtbot.addWidget(panel)
    try:
        with qtbot.waitSignal(sup.ready, timeout=10_000):
            sup.start("/m", {"host": "127.0.0.1", "port": helpers.free_port()})
        panel.set_endpoint(sup.base_url, None, "fake-model")
        panel.system_prompt.setPlainText("You are a helpful assistant.")
        panel.max_tokens.setValue(16)
        failures = []
        panel.reply_failed.connect(failures.append)
        for turn in range(10):
            panel.input.setPlainText(f"Question number {turn} about the weather today")
            with qtbot.waitSignal(panel.reply_finished, timeout=10_000):
                panel.send_button.click()
        assert failures == []
        sent = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(sent) == 10
        for body in sent:  # every request fit, began with the system prompt and ended with the new question
            assert body["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
            assert body["messages"][1]["role"] == "user" and body["messages"][-1]["content"].startswith("Question")
        assert len(sent[-1]["messages"]) < 2 * 10 + 1  # old turns were left out
        notes = [m for m in panel.view.messages if m.role == "note"]
        assert any("oldest message" in m.text for m in notes)
        assert any(m.role == "note" for m in panel.store.messages(panel.conversation_id))  # stored with the chat
        assert "Left out the" in panel.view.toPlainText()
        assert sum(m.role == "assistant" for m in panel.view.messages) == 10
    finally:
        panel.client.wait_idle()
        sup.shutdown()


def test_ten_turns_against_a_real_tiny_engine_with_a_128_token_context(tiny_model_dir):
    """The real server's /tokenize count and its own context check agree: no send is refused."""
    from server_harness import MODEL_NAME, start_server

    from app.chat_client import ChatRequest, ChatWorker

    server = start_server(tiny_model_dir("llama"), max_model_len=128)
    try:
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        fits, failures = [], []
        for turn in range(10):
            messages.append({"role": "user", "content": f"Tell me about the weather on day {turn} please"})
            worker = ChatWorker(ChatRequest(server.url, MODEL_NAME, list(messages), temperature=0.0, max_tokens=100))
            worker.fitted.connect(fits.append)
            worker.failed.connect(failures.append)
            result = worker._stream()  # on this thread: no event loop needed
            assert result.finish_reason in ("stop", "length")
            messages.append({"role": "assistant", "content": result.text or "ok"})
        assert failures == []
        notes = [fit.note() for fit in fits]
        print("\n".join(notes))
        assert any(fit.dropped for fit in fits) and any(fit.max_tokens < 100 for fit in fits)
        assert all(fit.messages[0]["role"] == "system" for fit in fits)
    finally:
        server.stop()
