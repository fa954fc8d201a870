"""ResponseStore: the bounded in-memory store behind `previous_response_id` and GET /v1/responses/{id}.

A response created with `store` unset or true is kept with its conversation (the input messages and the
reply as chat messages, instructions excluded, as OpenAI does not carry them over), so a later request
naming it as `previous_response_id` continues that conversation. The store holds at most `capacity`
responses and `max_bytes` of them, dropping the least recently used first; a response larger than
`max_bytes` by itself is not kept. Each is kept as compact JSON, so the byte bound is what the store holds:
the parsed objects of a body of many small keys take ten times their JSON size, and a 4 MiB body once held
25-42 MiB per stored response. Nothing is written to disk and a restart forgets all. A response created
with `store: false` is not kept, and naming an unknown id is a 400 naming the field.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

DEFAULT_CAPACITY = 256
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


def _compact(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class StoredResponse:
    """One stored response: the Response object as sent, and the conversation so far as chat messages (every
    turn, the reply included), each held as JSON and parsed again when read."""

    __slots__ = ("_response", "_conversation")

    def __init__(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._response, self._conversation = _compact(response), _compact(conversation)

    @property
    def response(self) -> dict[str, Any]:
        return json.loads(self._response)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return json.loads(self._conversation)

    @property
    def num_bytes(self) -> int:
        return len(self._response) + len(self._conversation)


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def describe(self) -> str:
        """The bound in words, for the errors that name an id the store does not hold."""
        return f"the last {self.capacity} responses, at most {self.max_bytes / 2**20:g} MiB of them,"

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep it (the least recently used go first while either bound is passed); False when it alone is
        larger than max_bytes and was not kept."""
        with self._lock:
            old = self._items.pop(response_id, None)
            if old is not None:
                self.num_bytes -= old.num_bytes
            if stored.num_bytes > self.max_bytes:
                return False
            self._items[response_id] = stored
            self.num_bytes += stored.num_bytes
            while len(self._items) > self.capacity or self.num_bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self.num_bytes -= dropped.num_bytes
            return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            stored = self._items.pop(response_id, None)
            if stored is not None:
                self.num_bytes -= stored.num_bytes
            return stored is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
