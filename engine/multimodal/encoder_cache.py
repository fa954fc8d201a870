"""EncoderCacheManager: the scheduler's book of which images' embeddings the worker holds (vLLM's encoder cache).

An image is encoded once, when the first prompt chunk that reaches its placeholders is scheduled, and its
embeddings stay on the worker while any request still has placeholders of it to compute; a request lets go of an
image once its computed tokens pass the image's end (or it finishes, or is aborted). Entries nobody holds stay
cached, least recently used first, until their room is needed: then they are evicted and the worker is told to
drop them (`EncoderWork.free`, before the step's new encodings). Each step may encode at most `budget`
embeddings (so a large image does not take a step that decodes from everyone else: the chunk stops before an
image that does not fit and takes it next step), and the cache holds at most `capacity` embeddings. Counts are
embeddings, the tower's output rows, which is what the worker's memory and the tower's work grow with.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.multimodal.inputs import MultiModalItem


@dataclass(slots=True)
class EncoderWork:
    """What one step asks of the encoder: drop these entries, then encode these items."""

    encode: list[MultiModalItem] = field(default_factory=list)
    free: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.encode or self.free)


class EncoderCacheManager:
    def __init__(self, budget: int, capacity: int) -> None:
        assert capacity >= budget > 0
        self.budget, self.capacity = budget, capacity
        self.sizes: dict[str, int] = {}  # mm_hash -> embeddings, every entry the worker holds (or will this step)
        self.holders: dict[str, set[str]] = {}  # mm_hash -> request ids still needing it
        self.idle: OrderedDict[str, None] = OrderedDict()  # held by nobody: evictable, oldest first
        self.pending_free: list[str] = []
        self.num_encoded = 0  # images encoded since start (a prefix-cache or encoder-cache hit encodes none)

    @property
    def used(self) -> int:
        return sum(self.sizes.values())

    def is_cached(self, mm_hash: str) -> bool:
        return mm_hash in self.sizes

    def hold(self, request_id: str, mm_hash: str) -> None:
        """`request_id` needs an entry that is (or is being) cached."""
        self.holders.setdefault(mm_hash, set()).add(request_id)
        self.idle.pop(mm_hash, None)

    def can_encode(self, item: MultiModalItem, budget_left: int, pending: int = 0) -> bool:
        """Room for `item` this step: within what is left of the step's budget, and in the cache once idle
        entries are evicted (`pending`: embeddings of items already chosen but not yet allocated)."""
        if item.num_embeds > budget_left:
            return False
        evictable = sum(self.sizes[h] for h in self.idle)
        return self.used - evictable + pending + item.num_embeds <= self.capacity

    def allocate(self, request_id: str, item: MultiModalItem) -> None:
        """Reserve `item`'s entry (evicting idle ones as needed) for an encoding this step."""
        while self.used + item.num_embeds > self.capacity:
            evicted, _ = self.idle.popitem(last=False)
            del self.sizes[evicted]
            self.holders.pop(evicted, None)
            self.pending_free.append(evicted)
        self.sizes[item.mm_hash] = item.num_embeds
        self.num_encoded += 1
        self.hold(request_id, item.mm_hash)

    def release(self, request_id: str, mm_hash: str) -> None:
        holders = self.holders.get(mm_hash)
        if holders is None or request_id not in holders:
            return
        holders.discard(request_id)
        if not holders and mm_hash in self.sizes:
            self.idle[mm_hash] = None

    def release_request(self, request_id: str, items: list[MultiModalItem]) -> None:
        for item in items:
            self.release(request_id, item.mm_hash)

    def take_frees(self) -> list[str]:
        frees, self.pending_free = self.pending_free, []
        return frees

    def reset(self) -> None:
        """Forget every entry (the worker drops them all with the frees returned next)."""
        self.pending_free += list(self.sizes)
        self.sizes.clear()
        self.holders.clear()
        self.idle.clear()
