"""The chat on a full disk: SQLite's own "database or disk is full" (forced with a page quota on the chat
database, `PRAGMA max_page_count`) never escapes the send slot; the chat says the history could not be
saved, keeps the conversation in memory (shown and sent as history) and saves it with the next message
once there is room; the store itself stays consistent (a refused write leaves nothing half-written)."""
import qt_helpers as helpers

import sqlite3

import pytest
from PySide6.QtCore import QSettings

from app.chat_panel import ChatPanel
from app.chat_store import ChatStore
from test_app_chat_failures import base_url  # noqa: F401 - the fake server fixture

BIG = "x" * 20_000  # bigger than the pages the quota leaves


def _fill_disk(store: ChatStore) -> None:
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")


def _free_disk(store: ChatStore) -> None:
    store._db.execute("PRAGMA max_page_count = 1073741823")


def test_the_store_refuses_whole_writes_when_full(tmp_path):
    store = ChatStore(tmp_path / "chat.db")
    cid = store.new_conversation()
    store.add_message(cid, "user", "fits")
    _fill_disk(store)
    with pytest.raises(sqlite3.OperationalError, match="full"):
        store.add_message(cid, "user", BIG)
    assert [m.content for m in store.messages(cid)] == ["fits"]
    assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_full_disk_keeps_the_chat_in_memory_and_saves_it_later(qtbot, tmp_path, base_url):  # noqa: F811
    store = ChatStore(tmp_path / "chat.db")
    panel = ChatPanel(store, QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(panel)
    panel.set_endpoint(base_url, None, "fake-model")
    cid = panel.conversation_id
    _fill_disk(store)
    panel.input.setPlainText(BIG)
    with qtbot.waitSignal(panel.reply_finished, timeout=10_000) as done:
        panel.send_button.click()  # raised sqlite3.OperationalError out of this slot before
    assert panel.save_notice.text() == "chat history could not be saved: disk full"
    assert store.messages(cid) == []  # nothing half-written
    assert [m.role for m in panel.view.messages] == ["user", "assistant"]  # the conversation is on screen
    assert [m["content"] for m in panel._history()][-2:] == [BIG, done.args[0].text]  # and in the next history
    _free_disk(store)
    panel.input.setPlainText("and now?")
    with qtbot.waitSignal(panel.reply_finished, timeout=10_000):
        panel.send_button.click()
    assert [(m.role, m.content[:8]) for m in store.messages(cid)] == [
        ("user", BIG[:8]), ("assistant", done.args[0].text[:8]), ("user", "and now?"), ("assistant", "Hello fr")]
    assert panel.save_notice.text() == ""
    panel.client.wait_idle()
