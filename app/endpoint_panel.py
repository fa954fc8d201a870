"""The Endpoint tab: base URL, API key, copy buttons and ready-to-paste curl, Python and agent CLI snippets.

Everything shown is derived from the values (base URL, API key, served model name, context length) set by the
main window when the engine's settings change or it becomes ready. The agent CLIs' lines (Claude Code, Codex,
opencode) are app/agent_wiring.py's, the same that `pagedesk launch` runs.
"""
from __future__ import annotations

import json

from app.agent_wiring import AGENTS, PACKAGES, Endpoint, wiring

from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (QFormLayout, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton,
                               QVBoxLayout, QWidget)


def curl_snippet(base_url: str, api_key: str | None, model: str) -> str:
    # max_tokens bounds the wait: without it a reply may run to the context's end before anything prints.
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64,
                       "stream": False})
    auth = f" \\\n  -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (f"curl {base_url}/v1/chat/completions \\\n  -H 'Content-Type: application/json'{auth} \\\n"
            f"  -d '{body}'")


def python_snippet(base_url: str, api_key: str | None, model: str) -> str:
    return (
        "from openai import OpenAI\n\n"
        f"client = OpenAI(base_url={base_url + '/v1'!r}, api_key={api_key or 'EMPTY'!r})\n"
        "stream = client.chat.completions.create(\n"
        f"    model={model!r},\n"
        "    messages=[{\"role\": \"user\", \"content\": \"Hello!\"}],\n"
        "    stream=True,\n"
        ")\n"
        "for chunk in stream:\n"
        "    print(chunk.choices[0].delta.content or \"\", end=\"\", flush=True)\n")


DEFAULT_CONTEXT = 32768  # the agents' window when the settings leave max_model_len to the model
AGENT_TITLES = {"claude": "Claude Code (Anthropic Messages API)", "codex": "Codex (Responses API)",
                "opencode": "opencode (chat completions)"}


def agents_snippet(base_url: str, api_key: str | None, model: str, context_length: int | None = None) -> str:
    endpoint = Endpoint(base_url, api_key, model, context_length or DEFAULT_CONTEXT)
    blocks = []
    for agent in AGENTS:
        binary = PACKAGES[agent][1]
        blocks.append(f"# {AGENT_TITLES[agent]}\npagedesk launch {agent} --url {base_url}\n# or by hand:\n"
                      f"{wiring(agent, endpoint).shell(binary)}")
    return "\n\n".join(blocks) + "\n"


class EndpointPanel(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        self.state = QLabel("Engine not running: the values below are what it will serve on.")
        self.base_url = QLineEdit(readOnly=True)
        self.api_key = QLineEdit(readOnly=True, placeholderText="(none: the endpoint is open)")
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.show_key = QPushButton("Show", checkable=True)
        self.show_key.toggled.connect(lambda on: self.api_key.setEchoMode(
            QLineEdit.EchoMode.Normal if on else QLineEdit.EchoMode.Password))
        self.curl = QPlainTextEdit(readOnly=True)
        self.python = QPlainTextEdit(readOnly=True)
        self.agents = QPlainTextEdit(readOnly=True)
        for edit in (self.curl, self.python, self.agents):
            edit.setFont(mono)
        form = QFormLayout()
        form.addRow("Base URL", self._with_copy(self.base_url, self.base_url.text))
        form.addRow("API key", self._with_copy(self.api_key, self.api_key.text, self.show_key))
        layout = QVBoxLayout(self)
        layout.addWidget(self.state)
        layout.addLayout(form)
        for title, edit in (("curl", self.curl), ("Python (openai SDK)", self.python),
                            ("Agent CLIs (Claude Code, Codex, opencode)", self.agents)):
            layout.addLayout(self._with_copy(QLabel(f"<b>{title}</b>"), edit.toPlainText))
            layout.addWidget(edit, 1)
        self.set_endpoint("http://127.0.0.1:8000", None, "model")

    @staticmethod
    def _with_copy(widget: QWidget, text_fn, *extra: QWidget) -> QHBoxLayout:
        row = QHBoxLayout()
        row.addWidget(widget, 1)
        for w in extra:
            row.addWidget(w)
        row.addWidget(QPushButton("Copy", clicked=lambda: QGuiApplication.clipboard().setText(text_fn())))
        return row

    def set_endpoint(self, base_url: str, api_key: str | None, model: str, running: bool = False,
                     context_length: int | None = None) -> None:
        self.base_url.setText(base_url + "/v1")
        self.api_key.setText(api_key or "")
        self.curl.setPlainText(curl_snippet(base_url, api_key, model))
        self.python.setPlainText(python_snippet(base_url, api_key, model))
        self.agents.setPlainText(agents_snippet(base_url, api_key, model, context_length))
        self.state.setText("Engine READY: the endpoint below is live." if running else
                           "Engine not running: the values below are what it will serve on.")
