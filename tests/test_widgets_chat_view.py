"""Chat view: Markdown with fenced code becomes HTML, raw HTML is escaped, streaming redraws on a timer."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

from widgets.chat_view import ChatMessage, ChatView, render_markdown


def test_fenced_code_and_escaping():
    html = render_markdown("Hi **there**\n\n```python\nprint(x < 1)\n```\n\n<script>alert(1)</script> <b>x</b>")
    assert "<strong>there</strong>" in html
    assert "<pre><code" in html and "print(x &lt; 1)" in html  # escaped once, not twice
    assert "<script>" not in html and "&lt;script&gt;" in html and "<b>" not in html


def test_streaming_appends_render_on_timer(qtbot):
    view = ChatView(redraw_ms=20)
    qtbot.addWidget(view)
    view.add_message(ChatMessage("user", "hello"))
    view.add_message(ChatMessage("assistant", ""))
    for word in ["Streaming", " works", " `fine`"]:
        view.append_to_last(word)
    qtbot.waitUntil(lambda: "Streaming works" in view.toPlainText(), timeout=2000)
    view.set_last_stats("TTFT 12 ms")
    assert "TTFT 12 ms" in view.toPlainText()
