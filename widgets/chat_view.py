"""Chat transcript view: messages rendered from Markdown (fenced code included) into a QTextBrowser.

`ChatView` holds a list of `ChatMessage` (role, Markdown text, a stats line) and renders them as
HTML through python-markdown. A reply's title names the model that wrote it ("Assistant · qwen"), and
only a reply still being written shows "…". Streaming appends to the last message are cheap: they mark the view
dirty and the HTML is rebuilt on a short timer, never per token. A message's reasoning ("thinking")
shows as a collapsed block that a click on its header opens or closes. A message's attached images (local files)
show as thumbnails under its text, at most THUMBNAIL_PX on a side. It knows nothing about HTTP.
"""
from __future__ import annotations

import functools
import html
from dataclasses import dataclass

import markdown
from PySide6.QtCore import QTimer, QUrl
from PySide6.QtGui import QDesktopServices, QImageReader
from PySide6.QtWidgets import QTextBrowser, QWidget

STYLE = """
<style>
 body { font-size: 10pt; }
 .role { font-weight: bold; margin-top: 10px; }
 .user { color: #5e81ac; } .assistant { color: #a3be8c; } .system { color: #b48ead; } .error { color: #bf616a; }
 .note { color: #d08770; }
 .stats { color: #808890; font-size: 8pt; }
 .thinking { color: #808890; font-style: italic; }
 pre { background: #1e222a; color: #e5e9f0; padding: 6px; font-family: monospace; }
 code { background: #2e3440; color: #ebcb8b; font-family: monospace; }
</style>
"""
THUMBNAIL_PX = 120
_MD_EXTENSIONS = ["fenced_code", "tables", "sane_lists", "nl2br"]


@functools.cache
def _markdown() -> markdown.Markdown:
    md = markdown.Markdown(extensions=_MD_EXTENSIONS)
    # Raw HTML from a model is shown as text, never interpreted: drop the raw-HTML block and inline rules.
    md.preprocessors.deregister("html_block")
    md.inlinePatterns.deregister("html")
    return md


def render_markdown(text: str) -> str:
    """Markdown → HTML with fenced code; raw HTML in the text comes out escaped. GUI thread only."""
    md = _markdown()
    md.reset()
    return md.convert(text)


@dataclass
class ChatMessage:
    role: str  # user | assistant | system | error | note
    text: str
    stats: str = ""
    reasoning: str = ""  # the model's thinking, shown collapsed
    reasoning_open: bool = False
    model: str = ""  # for a reply: the model that wrote it
    pending: bool = False  # a reply still being written: "…" until its first text
    images: tuple[str, ...] = ()  # paths of attached image files, shown as thumbnails


def thumbnail_html(path: str, max_px: int = THUMBNAIL_PX) -> str:
    """An <img> of a local image file scaled to fit `max_px` (aspect kept); a missing file says so in words."""
    size = QImageReader(path).size()
    if not size.isValid():
        return f'<span class="stats">[image missing: {html.escape(path.rsplit("/", 1)[-1])}]</span>'
    scale = min(1.0, max_px / max(size.width(), size.height(), 1))
    url = html.escape(QUrl.fromLocalFile(path).toString(), quote=True)
    return (f'<img src="{url}" width="{max(1, round(size.width() * scale))}" '
            f'height="{max(1, round(size.height() * scale))}">')


class ChatView(QTextBrowser):
    """Renders a conversation; `append_to_last` for streamed tokens, redrawn every `redraw_ms`."""

    ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System", "error": "Error", "note": "Note"}

    def __init__(self, parent: QWidget | None = None, redraw_ms: int = 100) -> None:
        super().__init__(parent)
        self.setOpenLinks(False)  # links are handled here: thinking toggles, http(s) in the browser
        self.anchorClicked.connect(self._on_anchor)
        self.messages: list[ChatMessage] = []
        self._dirty = False
        self._timer = QTimer(self, interval=redraw_ms, timeout=self._redraw_if_dirty)
        self._timer.start()

    def set_messages(self, messages: list[ChatMessage]) -> None:
        self.messages = list(messages)
        self.rerender()

    def add_message(self, message: ChatMessage) -> None:
        self.messages.append(message)
        self.rerender()

    def append_to_last(self, delta: str) -> None:
        assert self.messages, "append_to_last needs a message to extend"
        self.messages[-1].text += delta
        self._dirty = True

    def append_reasoning_to_last(self, delta: str) -> None:
        assert self.messages, "append_reasoning_to_last needs a message to extend"
        self.messages[-1].reasoning += delta
        self._dirty = True

    def toggle_reasoning(self, index: int) -> None:
        self.messages[index].reasoning_open = not self.messages[index].reasoning_open
        self.rerender()

    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() == "thinking":
            self.toggle_reasoning(int(url.path() or url.host() or 0))
        elif url.scheme() in ("http", "https"):
            QDesktopServices.openUrl(url)

    def set_last_stats(self, stats: str) -> None:
        if self.messages:
            self.messages[-1].stats = stats
            self.rerender()

    def _redraw_if_dirty(self) -> None:
        if self._dirty:
            self.rerender()

    def rerender(self) -> None:
        self._dirty = False
        parts = [STYLE]
        for i, m in enumerate(self.messages):
            title = self.ROLE_TITLES.get(m.role, m.role) + (f" · {html.escape(m.model)}" if m.model else "")
            parts.append(f'<div class="role {m.role}">{title}</div>')
            if m.reasoning:
                arrow = "▾" if m.reasoning_open else "▸"
                parts.append(f'<div class="thinking"><a href="thinking:{i}">{arrow} Thinking '
                             f'({len(m.reasoning)} characters)</a></div>')
                if m.reasoning_open:
                    parts.append(f'<div class="thinking">{render_markdown(m.reasoning)}</div>')
            parts.append(render_markdown(m.text) if m.text else "<p>…</p>" if m.pending else
                         '<p class="stats">(no text)</p>')
            if m.images:
                parts.append(f'<p>{"&nbsp;".join(thumbnail_html(path) for path in m.images)}</p>')
            if m.stats:
                parts.append(f'<div class="stats">{html.escape(m.stats)}</div>')
        self.setHtml("".join(parts))
        self._scroll_to_end()

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        """A transcript filled while hidden (a chat reopened after a restart) had no height to scroll by:
        open it at the last message once it has one."""
        super().showEvent(event)
        QTimer.singleShot(0, self._scroll_to_end)
