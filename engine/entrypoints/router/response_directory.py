"""ResponseDirectory: which engine made each /v1/responses id, so the router can send what names it back there.

Each engine keeps its own responses (engine/entrypoints/openai/responses_store.py), so behind the router a GET or DELETE
of /v1/responses/{id}, and a POST chaining `previous_response_id`, must reach the replica that created the id.
The router reads the id from the engine's reply as it relays it (the JSON body, or the first SSE event of a
stream: `response.created`) and remembers (model, replica index) for it, bounded, least recently used dropped
first. An id it does not know was made before this router started or was forgotten; an engine restarted since
has lost its store anyway, and its own 404/400 says so. Torch-free, like the rest of the router.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator

DEFAULT_CAPACITY = 4096  # engines keep 256 each by default: room for several models and replicas
HEAD_BYTES = 8192  # how far into a stream the id must appear (it is in the first event)
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,200})"')


@dataclass(frozen=True, slots=True)
class ResponseOwner:
    model: str  # the router's model name
    replica: int  # EngineProcess.index


class ResponseDirectory:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._owners: OrderedDict[str, ResponseOwner] = OrderedDict()  # one event loop: no lock needed

    def remember(self, response_id: str, owner: ResponseOwner) -> None:
        self._owners[response_id] = owner
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> ResponseOwner | None:
        owner = self._owners.get(response_id)
        if owner is not None:
            self._owners.move_to_end(response_id)
        return owner

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._owners)

    def remember_body(self, content: bytes, owner: ResponseOwner) -> None:
        """A whole JSON reply of POST /v1/responses."""
        try:
            response_id = json.loads(content).get("id")
        except (ValueError, AttributeError):
            return
        if isinstance(response_id, str) and response_id.startswith("resp_"):
            self.remember(response_id, owner)

    async def remember_stream(self, chunks: AsyncIterator[bytes], owner: ResponseOwner) -> AsyncIterator[bytes]:
        """Pass a streamed reply through unchanged, noting the id from its head."""
        head, found = b"", False
        async for chunk in chunks:
            if not found and len(head) < HEAD_BYTES:
                head += chunk if isinstance(chunk, bytes) else chunk.encode()
                match = RESPONSE_ID.search(head)
                if match:
                    self.remember(match.group(1).decode(), owner)
                    found = True
            yield chunk
