"""ResponseStore: the bounded in-memory store behind `previous_response_id` and GET /v1/responses/{id}.

A response created with `store` unset or true is kept with its conversation (the input messages and the
reply as chat messages, instructions excluded, as OpenAI does not carry them over), so a later request
naming it as `previous_response_id` continues that conversation. The store holds at most `capacity`
responses and drops the least recently used; nothing is written to disk and a restart forgets all.
A response created with `store: false` is not kept, and naming an unknown id is a 400 naming the field.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 256


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as sent
    conversation: list[dict[str, Any]]  # chat messages: every turn so far, the reply included


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
