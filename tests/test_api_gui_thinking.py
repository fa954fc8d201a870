"""The GUI chat shows reasoning_content deltas as a collapsed "thinking" block that a click opens."""
from __future__ import annotations

from PySide6.QtCore import QUrl

from app.chat_client import ChatRequest, ChatResult, ChatWorker
from widgets.chat_view import ChatMessage, ChatView


def test_reasoning_deltas_are_collected_apart_from_content(qtbot):
    worker = ChatWorker(ChatRequest("http://127.0.0.1:1/v1", "tiny", []))
    reasoning, content = [], []
    worker.reasoning_delta.connect(reasoning.append)
    worker.delta.connect(content.append)
    result = ChatResult()
    for delta in ({"reasoning_content": "let me "}, {"reasoning_content": "think"}, {"content": "4"}):
        worker._take_chunk({"choices": [{"index": 0, "delta": delta}]}, result, 0.0)
    assert (result.reasoning, result.text) == ("let me think", "4")
    assert ("".join(reasoning), content) == ("let me think", ["4"])


def test_thinking_block_is_collapsed_until_clicked(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.add_message(ChatMessage("assistant", "The answer."))
    view.append_reasoning_to_last("secret chain of thought")
    view.rerender()
    text = view.toPlainText()
    assert "Thinking (23 characters)" in text and "secret chain" not in text and "The answer." in text
    view.anchorClicked.emit(QUrl("thinking:0"))
    assert "secret chain of thought" in view.toPlainText()
    view.anchorClicked.emit(QUrl("thinking:0"))
    assert "secret chain" not in view.toPlainText()
