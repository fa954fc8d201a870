"""Conversations kept in SQLite under the user's data directory (app.paths.data_dir()).

Two tables: conversations (title, system prompt, sampling settings, times) and messages (role,
content, a stats line such as "TTFT 120 ms · 35 tokens/s", for a reply the model that wrote it, and for a user
turn the names of its attached images, space-separated, in app/chat_images.py's folder beside this file; a file
from before those columns gets them, empty, when opened). Small synchronous queries on a local
file; the GUI calls them directly, as they take well under a millisecond.
"""
from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, stats TEXT NOT NULL DEFAULT '', created REAL NOT NULL,
    model TEXT NOT NULL DEFAULT '', images TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


@dataclass(frozen=True, slots=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    updated: float


@dataclass(frozen=True, slots=True)
class StoredMessage:
    id: int
    role: str
    content: str
    stats: str
    model: str = ""  # the model that wrote a reply
    images: tuple[str, ...] = ()  # names of the attached images (app/chat_images.py), in order


class ChatStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db = sqlite3.connect(self.path)
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(messages)")}
        for column in ("model", "images"):
            if column not in columns:
                with self._db:
                    self._db.execute(f"ALTER TABLE messages ADD COLUMN {column} TEXT NOT NULL DEFAULT ''")

    def close(self) -> None:
        self._db.close()

    def new_conversation(self, title: str = "New chat", system_prompt: str = "") -> int:
        now = time.time()
        with self._db:
            cur = self._db.execute("INSERT INTO conversations (title, system_prompt, created, updated) "
                                   "VALUES (?, ?, ?, ?)", (title, system_prompt, now, now))
        return int(cur.lastrowid)

    def conversations(self) -> list[Conversation]:
        rows = self._db.execute("SELECT id, title, system_prompt, updated FROM conversations ORDER BY updated DESC")
        return [Conversation(*row) for row in rows]

    def conversation(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute("SELECT id, title, system_prompt, updated FROM conversations WHERE id = ?",
                               (conversation_id,)).fetchone()
        return Conversation(*row) if row else None

    def update_conversation(self, conversation_id: int, *, title: str | None = None,
                            system_prompt: str | None = None) -> None:
        with self._db:
            if title is not None:
                self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))
            if system_prompt is not None:
                self._db.execute("UPDATE conversations SET system_prompt = ? WHERE id = ?",
                                 (system_prompt, conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self._db.execute("SELECT id, role, content, stats, model, images FROM messages "
                                "WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        return [StoredMessage(*row[:5], tuple(row[5].split())) for row in rows]

    def add_message(self, conversation_id: int, role: str, content: str, stats: str = "", model: str = "",
                    images: tuple[str, ...] = ()) -> int:
        now = time.time()
        with self._db:
            cur = self._db.execute("INSERT INTO messages (conversation_id, role, content, stats, model, images, "
                                   "created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                                   (conversation_id, role, content, stats, model, " ".join(images), now))
            self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return int(cur.lastrowid)

    def restore_conversation(self, title: str, system_prompt: str, updated: float,
                             messages: list[tuple[str, ...]]) -> int:
        """A deleted conversation back with its messages (role, content, stats[, model[, images]]) and its old `updated` time, so
        it returns to its place in the list (the list is newest first); one transaction."""
        now = time.time()
        with self._db:
            cur = self._db.execute("INSERT INTO conversations (title, system_prompt, created, updated) "
                                   "VALUES (?, ?, ?, ?)", (title, system_prompt, now, updated))
            conversation_id = int(cur.lastrowid)
            self._db.executemany("INSERT INTO messages (conversation_id, role, content, stats, model, images, created) "
                                 "VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 [(conversation_id, *m[:3], m[3] if len(m) > 3 else "",
                                   " ".join(m[4]) if len(m) > 4 else "", now) for m in messages])
        return conversation_id

    def delete_message(self, message_id: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))
