"""The Chat tab: conversations list, editable system prompt, sampling settings, transcript and input.

Sending stores the user turn in the `ChatStore`, streams the reply through `ChatClient` (a worker
thread) into the `ChatView`, and stores the reply with its TTFT and tokens/s line and the model that wrote
it, which its title names. The model is the one picked above the chat (every model the endpoint serves that
is loaded or can load); a new chat keeps it. A failed reply
is stored too (any partial text, then the error), so a reopened chat reads as it happened; turns
left unanswered are not sent again as history, so the model never sees two user turns in a row.
A request changed to fit the model's context (Max tokens lowered, oldest turns left out: app/context_fit.py)
gets a note in the chat, stored with it; a meter shows the tokens the chat holds out of the model's context. Stop ends the stream; Regenerate (once the chat has a message) drops the last reply, and the notes
made for it, and asks again. Deleting a chat can be undone
until the next deletion. New chats start from the default system prompt; sampling settings persist
in QSettings. The endpoint (base URL, key, served model name) is set by the main window. When the store
cannot write (a full disk), the chat says "chat history could not be saved: disk full", keeps the unsaved
turns in memory (shown, and sent as history) and writes them before the next message. Images are attached by the
Attach button, by dropping files or pictures on the chat, or by pasting into the input (app/chat_input.py); they
are stored beside the chat (app/chat_images.py), shown as thumbnails in the message and sent as `image_url` parts
with every later request of the chat (so Regenerate sends them again). The Attach button is off, its tooltip saying
why, while the picked model's /v1/models entry does not list image input.
"""
from __future__ import annotations

import sqlite3

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtWidgets import (QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QListWidget,
                               QListWidgetItem, QPlainTextEdit, QProgressBar, QPushButton, QSpinBox, QSplitter,
                               QVBoxLayout, QWidget)

from app.chat_client import ChatClient, ChatRequest, ChatResult
from app.chat_images import ChatImages
from app.chat_input import ChatInput, dropped_images, offers_images
from app.chat_store import ChatStore
from app.loaded_models import ChatModelChoice
from widgets.chat_view import ChatMessage, ChatView, thumbnail_html

NOT_RUNNING = "The engine is not running. Choose a model and press **Start** (Engine tab), then send again."
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
ATTACH_TIP = "Attach images (or drop them on the chat, or paste one with Ctrl+V)"
ATTACH_NOT_RUNNING = "Start the engine to attach images."


def text_only_tip(model: str) -> str:
    return (f"{model or 'This model'} takes text only: its /v1/models entry lists no image input. Serve a "
            "vision-language checkpoint (with its image processor) to attach images.")


def save_failed_text(exc: sqlite3.Error) -> str:
    reason = "disk full" if "full" in str(exc).lower() else str(exc)
    return f"chat history could not be saved: {reason}"


class ChatPanel(QWidget):
    reply_finished = Signal(object)  # ChatResult
    reply_failed = Signal(str)

    def __init__(self, store: ChatStore, settings: QSettings | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.images = ChatImages.beside(store.path)
        self.attached: list[str] = []  # image names attached to the message being written
        self._rows: list = []  # app.loaded_models.ModelRow of every servable model: who takes images
        self.settings = settings
        self._deleted: tuple | None = None  # (Conversation, messages) of the last deleted chat
        self.client = ChatClient(self)
        self.client.fitted.connect(self._on_fitted)
        self.client.context_used.connect(self._on_context_used)
        self.client.delta.connect(self._on_delta)
        self.client.reasoning_delta.connect(self._on_reasoning_delta)
        self.client.finished.connect(self._on_finished)
        self.client.failed.connect(self._on_failed)
        self.base_url: str | None = None
        self.api_key: str | None = None
        self.model = ""
        self.generating = False
        self.conversation_id: int | None = None
        self._build()
        self._load_conversations()

    # ---- layout -------------------------------------------------------------------------------------
    def _build(self) -> None:
        self.conversation_list = QListWidget()
        self.conversation_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conversation_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conversation_list.currentItemChanged.connect(self._on_conversation_chosen)
        self.new_button = QPushButton("New chat", clicked=self.new_conversation)
        self.delete_button = QPushButton("Delete", clicked=self.delete_conversation)
        self.undo_button = QPushButton("Undo delete", clicked=self.undo_delete, visible=False)
        left = QWidget()
        left.setFixedWidth(220)  # titles come and go (delete, undo): the sidebar never jumps in width
        left_layout = QVBoxLayout(left)
        left_layout.addWidget(self.conversation_list, 1)
        buttons = QHBoxLayout()
        buttons.addWidget(self.new_button)
        buttons.addWidget(self.delete_button)
        left_layout.addLayout(buttons)
        left_layout.addWidget(self.undo_button)

        self.system_prompt = QPlainTextEdit(DEFAULT_SYSTEM_PROMPT)
        self.system_prompt.setMaximumHeight(60)
        self.system_prompt.textChanged.connect(self._save_system_prompt)
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, value=0.7)
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1.0, singleStep=0.05, value=1.0)
        self.max_tokens = QSpinBox(minimum=1, maximum=131072, value=512)
        self._restore_sampling()
        params = QHBoxLayout()
        for label, widget in (("Temperature", self.temperature), ("top_p", self.top_p),
                              ("Max tokens", self.max_tokens)):
            params.addWidget(QLabel(label))
            params.addWidget(widget)
        params.addStretch(1)
        # A thin bar with its words beside it: text drawn over the fill splits into two colours.
        self.context_meter = QProgressBar(textVisible=False, minimumWidth=120, maximumWidth=200, maximumHeight=10,
                                          visible=False)
        self.context_text = QLabel(visible=False)
        for w in (self.context_meter, self.context_text):
            w.setToolTip("Tokens this chat holds (system prompt, history and the last reply) out of the model's "
                         "context (max_model_len), as the engine counts them")
        params.addWidget(self.context_meter)
        params.addWidget(self.context_text)
        self.view = ChatView()
        self.input = ChatInput(placeholderText="Message the model… (Ctrl+Enter to send)")
        self.input.setMaximumHeight(90)
        self.input.images_given.connect(self.attach_images)
        self.setAcceptDrops(True)  # a picture dropped anywhere on the chat is attached
        self.attach_button = QPushButton("Attach image…", clicked=self._choose_images, enabled=False,
                                         toolTip=ATTACH_NOT_RUNNING)
        self.attachments = QLabel(visible=False)  # "2 images attached" with their thumbnails
        self.clear_attachments = QPushButton("Remove images", clicked=self._clear_attached, visible=False)
        self.send_button = QPushButton("Send", clicked=self.send)
        self.send_button.setShortcut("Ctrl+Return")
        self.stop_button = QPushButton("Stop", clicked=self.stop, enabled=False)
        self.regenerate_button = QPushButton("Regenerate", clicked=self.regenerate)
        self.status = QLabel("")
        self.save_notice = QLabel("")  # says so while the history cannot be written (a full disk)
        # Messages the store refused (conversation id -> (role, content, stats, model, images) in order): kept in memory,
        # shown and sent as history, and written before the next message of that conversation.
        self._unsaved: dict[int, list[tuple[str, str, str, str, tuple[str, ...]]]] = {}
        self._reply_model = ""  # the model asked for the reply being written
        actions = QVBoxLayout()
        for b in (self.send_button, self.stop_button, self.regenerate_button, self.attach_button):
            actions.addWidget(b)
        input_row = QHBoxLayout()
        input_row.addWidget(self.input, 1)
        input_row.addLayout(actions)

        right = QWidget()
        form = QFormLayout()
        self.model_choice = ChatModelChoice()  # filled from the Loaded models list
        self.model_choice.model_picked.connect(self._pick_model)
        form.addRow("Model", self.model_choice)
        form.addRow("System prompt", self.system_prompt)
        right_layout = QVBoxLayout(right)
        right_layout.addLayout(form)
        right_layout.addLayout(params)
        right_layout.addWidget(self.view, 1)
        attached_row = QHBoxLayout()
        attached_row.addWidget(self.attachments, 1)
        attached_row.addWidget(self.clear_attachments)
        right_layout.addLayout(attached_row)
        right_layout.addLayout(input_row)
        right_layout.addWidget(self.status)
        right_layout.addWidget(self.save_notice)
        splitter = QSplitter()
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([200, 800])
        QVBoxLayout(self).addWidget(splitter)

    # ---- endpoint -------------------------------------------------------------------------------------
    def set_endpoint(self, base_url: str | None, api_key: str | None = None, model: str | None = None) -> None:
        """base_url None means the engine is not running; `model` is the main model, asked unless another is
        picked above the chat."""
        self.base_url, self.api_key = base_url, api_key
        if model and not self.model_choice.current():
            self.model = model
        self._update_buttons()

    def set_models(self, rows) -> None:
        """Every servable model (app.loaded_models.ModelRow): the picker offers them all."""
        self._rows = list(rows)
        self.model_choice.set_rows(rows)
        self._update_attach()

    def _pick_model(self, name: str) -> None:
        self.model = name
        self._update_attach()

    def takes_images(self) -> bool:
        """The model asked now lists image input in /v1/models."""
        row = next((r for r in self._rows if r.name == self.model), None)
        return row is not None and row.takes_images

    # ---- images -----------------------------------------------------------------------------------------
    def attach_images(self, images: list) -> None:
        """Attach (bytes, mime type) pictures to the message being written; refused while the model takes none."""
        if not self.attach_button.isEnabled():
            self.status.setText(self.attach_button.toolTip())
            return
        for data, mime in images:
            try:
                self.attached.append(self.images.put(data, mime))
            except (OSError, ValueError) as exc:
                self.status.setText(str(exc))
        self._show_attached()

    def _choose_images(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach images", "",
                                                "Images (*.png *.jpg *.jpeg *.gif *.webp *.bmp)")
        for path in paths:
            try:
                self.attached.append(self.images.put_file(path))
            except (OSError, ValueError) as exc:
                self.status.setText(str(exc))
        self._show_attached()

    def _clear_attached(self) -> None:
        self.attached.clear()
        self._show_attached()

    def _show_attached(self) -> None:
        n = len(self.attached)
        self.attachments.setText(f"{n} image{'s' if n != 1 else ''} attached: " + " ".join(
            thumbnail_html(str(self.images.path(name)), 48) for name in self.attached))
        self.attachments.setVisible(bool(n))
        self.clear_attachments.setVisible(bool(n))

    def dragEnterEvent(self, event) -> None:  # noqa: N802 - Qt's name
        if offers_images(event.mimeData()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:  # noqa: N802 - Qt's name
        images = dropped_images(event.mimeData())
        if images:
            self.attach_images(images)
            event.acceptProposedAction()

    # ---- conversations --------------------------------------------------------------------------------
    def _load_conversations(self) -> None:
        conversations = self.store.conversations()
        if not conversations:
            self.store.new_conversation(system_prompt=DEFAULT_SYSTEM_PROMPT)
            conversations = self.store.conversations()
        self.conversation_list.blockSignals(True)
        self.conversation_list.clear()
        for c in conversations:
            item = QListWidgetItem(c.title)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            self.conversation_list.addItem(item)
        self.conversation_list.blockSignals(False)
        row = next((i for i, c in enumerate(conversations) if c.id == self.conversation_id), 0)
        self.conversation_list.setCurrentRow(row)
        self._open(conversations[row].id)

    def _on_conversation_chosen(self, item: QListWidgetItem | None, _previous=None) -> None:
        if item is not None and not self.generating:
            self._open(int(item.data(Qt.ItemDataRole.UserRole)))

    def _open(self, conversation_id: int) -> None:
        if conversation_id == self.conversation_id and self.view.messages:
            return
        self.conversation_id = conversation_id
        for w in (self.context_meter, self.context_text):
            w.setVisible(False)  # counted again with this chat's next message
        conversation = self.store.conversation(conversation_id)
        self.system_prompt.blockSignals(True)
        self.system_prompt.setPlainText(conversation.system_prompt if conversation else "")
        self.system_prompt.blockSignals(False)
        self.view.set_messages([self._message(*m) for m in self._transcript(conversation_id)])
        self._update_buttons()

    def _transcript(self, conversation_id: int) -> list[tuple[str, str, str, str, tuple[str, ...]]]:
        """(role, content, stats, model, images) of the stored messages, then those not saved yet."""
        stored = [(m.role, m.content, m.stats, m.model, m.images) for m in self.store.messages(conversation_id)]
        return stored + self._unsaved.get(conversation_id, [])

    def _save(self, role: str, content: str, stats: str = "", model: str = "", images: tuple[str, ...] = ()) -> None:
        """Store a message of the open chat; when the store refuses (a full disk), keep it in memory, say so,
        and try again with the next message."""
        if self.conversation_id is None:
            return
        pending = self._unsaved.setdefault(self.conversation_id, [])
        pending.append((role, content, stats, model, images))
        try:
            while pending:
                self.store.add_message(self.conversation_id, *pending[0])  # one transaction each: all or nothing
                pending.pop(0)
        except sqlite3.Error as exc:
            self.save_notice.setText(save_failed_text(exc))
            return
        del self._unsaved[self.conversation_id]
        if not self._unsaved:
            self.save_notice.setText("")

    def new_conversation(self) -> None:
        if self.generating:
            return
        self.conversation_id = self.store.new_conversation(system_prompt=DEFAULT_SYSTEM_PROMPT)
        self.view.set_messages([])
        self._load_conversations()

    def delete_conversation(self) -> None:
        """Delete the open chat; a chat with messages can be brought back with Undo delete."""
        if self.generating or self.conversation_id is None:
            return
        conversation = self.store.conversation(self.conversation_id)
        messages = self.store.messages(self.conversation_id)
        self.store.delete_conversation(self.conversation_id)
        self._deleted = (conversation, messages) if conversation and messages else None
        self.undo_button.setText(f"Undo delete of “{conversation.title[:24]}”" if self._deleted else "Undo delete")
        self.undo_button.setVisible(self._deleted is not None)
        self.conversation_id = None
        self._load_conversations()

    def undo_delete(self) -> None:
        if self._deleted is None or self.generating:
            return
        conversation, messages = self._deleted
        self._deleted = None
        self.undo_button.setVisible(False)
        self.conversation_id = self.store.restore_conversation(
            conversation.title, conversation.system_prompt, conversation.updated,
            [(m.role, m.content, m.stats, m.model, m.images) for m in messages])
        self.view.set_messages([])
        self._load_conversations()

    def _save_system_prompt(self) -> None:
        if self.conversation_id is not None:
            self.store.update_conversation(self.conversation_id, system_prompt=self.system_prompt.toPlainText())

    # ---- sending ----------------------------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not (text or self.attached) or self.generating:
            return
        if self.base_url is None:
            self.view.add_message(ChatMessage("error", NOT_RUNNING))
            self.reply_failed.emit(NOT_RUNNING)
            return
        assert self.conversation_id is not None
        self.input.clear()
        images, self.attached = tuple(self.attached), []
        self._show_attached()
        self._save("user", text, images=images)
        conversation = self.store.conversation(self.conversation_id)
        if conversation and conversation.title == "New chat" and text:
            try:
                self.store.update_conversation(self.conversation_id, title=text.splitlines()[0][:40])
            except sqlite3.Error as exc:
                self.save_notice.setText(save_failed_text(exc))
            self._rename_current(text.splitlines()[0][:40])
        self.view.add_message(self._message("user", text, images=images))
        self._ask()

    def regenerate(self) -> None:
        """Drop the last reply and the notes made for it (its context fit), then ask again."""
        if self.generating or self.conversation_id is None:
            return
        stored = self.store.messages(self.conversation_id)
        if not any(m.role == "user" for m in stored) or self.base_url is None:
            return
        keep = len(stored)
        if stored[-1].role == "assistant":
            keep -= 1
            while keep and stored[keep - 1].role == "note":
                keep -= 1
            for m in stored[keep:]:
                self.store.delete_message(m.id)
            self.view.set_messages([self._message(m.role, m.content, m.stats, m.model, m.images)
                                    for m in stored[:keep]])
        self._ask()

    def stop(self) -> None:
        self.client.stop()

    def _history(self) -> list[dict]:
        assert self.conversation_id is not None
        messages = [{"role": "system", "content": self.system_prompt.toPlainText()}]
        if not messages[0]["content"].strip():
            messages = []
        turns = [(role, content, images) for role, content, _stats, _model, images
                 in self._transcript(self.conversation_id) if role in ("user", "assistant")]
        # A user turn whose reply failed is followed by another user turn: leave it out of the history.
        messages += [{"role": role, "content": self._content(content, images)}
                     for i, (role, content, images) in enumerate(turns)
                     if not (role == "user" and i + 1 < len(turns) and turns[i + 1][0] == "user")]
        return messages

    def _content(self, text: str, images: tuple[str, ...]):
        """A turn's content: its text, or with images the parts (images first, as the model cards show)."""
        if not images:
            return text
        parts = [{"type": "image_url", "image_url": {"url": self.images.data_url(name)}} for name in images]
        return parts + ([{"type": "text", "text": text}] if text else [])

    def _ask(self) -> None:
        row = next((r for r in self._rows if r.name == self.model), None)
        request = ChatRequest(self.base_url or "", self.model, self._history(), self.api_key,
                              self.temperature.value(), self.top_p.value(), self.max_tokens.value(),
                              max_model_len=(row.context or 0) if row is not None else 0)
        self._reply_model = self.model
        self.view.add_message(ChatMessage("assistant", "", model=self.model, pending=True))
        self._set_generating(True)
        self.client.send(request)

    def _on_fitted(self, fit) -> None:
        """Say how the request was fitted, just above the reply it concerns (a note is never sent as history)."""
        note = fit.note()
        if self.conversation_id is not None:
            self.store.add_message(self.conversation_id, "note", note)
        at = len(self.view.messages) - 1 if self.view.messages and self.view.messages[-1].role == "assistant" \
            else len(self.view.messages)
        self.view.messages.insert(at, ChatMessage("note", note))
        self.view.rerender()

    def _on_context_used(self, used: int, max_model_len: int) -> None:
        """The context meter: what the chat holds out of the model's context (red from 90 %)."""
        meter = self.context_meter
        meter.setRange(0, max_model_len)
        meter.setValue(min(used, max_model_len))
        meter.setFormat(f"Context {used:,} / {max_model_len:,} tokens")
        meter.setStyleSheet("QProgressBar::chunk { background: #bf616a; }" if used >= 0.9 * max_model_len else "")
        self.context_text.setText(meter.format())
        meter.setVisible(True)
        self.context_text.setVisible(True)

    def _on_delta(self, text: str) -> None:
        self.view.append_to_last(text)

    def _on_reasoning_delta(self, text: str) -> None:
        self.view.append_reasoning_to_last(text)

    def _on_finished(self, result: ChatResult) -> None:
        self._set_generating(False)
        stats = result.summary()
        model = result.model or self._reply_model
        self._save("assistant", result.text, stats, model)
        if self.view.messages and self.view.messages[-1].role == "assistant":
            self.view.messages[-1].model, self.view.messages[-1].pending = model, False
        self.view.set_last_stats(stats)
        self.reply_finished.emit(result)

    def _on_failed(self, message: str) -> None:
        self._set_generating(False)
        last = self.view.messages[-1] if self.view.messages else None
        if last is not None and last.role == "assistant" and not last.text:
            self.view.messages.pop()
        elif last is not None and last.role == "assistant":
            last.pending = False
            self._save("assistant", last.text, "incomplete", self._reply_model)
        self._save("error", message)
        self.view.add_message(ChatMessage("error", message))
        self.reply_failed.emit(message)

    def _set_generating(self, on: bool) -> None:
        self.generating = on
        self.send_button.setEnabled(not on)
        self.stop_button.setEnabled(on)
        for button in (self.new_button, self.delete_button, self.undo_button):
            button.setEnabled(not on)
        self.status.setText(self.model_choice.progress_line() if on else "")
        self._update_buttons()

    def _update_buttons(self) -> None:
        """Regenerate needs a running engine and a message of yours in this chat to answer again."""
        asked = self.conversation_id is not None and any(
            role == "user" for role, *_ in self._transcript(self.conversation_id))
        self.regenerate_button.setEnabled(not self.generating and self.base_url is not None and asked)
        self._update_attach()

    def _update_attach(self) -> None:
        """Attach needs a running engine and a model whose /v1/models entry lists image input (no store access:
        model lists arrive until the window is gone)."""
        can_attach = self.base_url is not None and self.takes_images()
        self.attach_button.setEnabled(can_attach)
        self.attach_button.setToolTip(ATTACH_TIP if can_attach else ATTACH_NOT_RUNNING if self.base_url is None
                                      else text_only_tip(self.model))

    def _restore_sampling(self) -> None:
        if self.settings is None:
            return
        for key, box, kind in self._sampling_boxes():
            value = self.settings.value(key)
            try:
                if value not in (None, ""):
                    box.setValue(kind(value))
            except (TypeError, ValueError):
                pass  # a corrupt stored value keeps the default
            box.valueChanged.connect(self._save_sampling)

    def _save_sampling(self, *_changed) -> None:
        if self.settings is not None:
            for key, box, _kind in self._sampling_boxes():
                self.settings.setValue(key, box.value())

    def _sampling_boxes(self):
        return (("chat/temperature", self.temperature, float), ("chat/top_p", self.top_p, float),
                ("chat/max_tokens", self.max_tokens, int))

    def _rename_current(self, title: str) -> None:
        item = self.conversation_list.currentItem()
        if item is not None:
            item.setText(title)


    def _message(self, role: str, content: str, stats: str = "", model: str = "",
                 images: tuple[str, ...] = ()) -> ChatMessage:
        return ChatMessage(role, content, stats, model=model,
                           images=tuple(str(self.images.path(name)) for name in images))
