"""BlockPool: the KV cache's physical blocks, their ref counts, prefix hashes and the free queue.

Free blocks sit in an intrusive doubly linked list threaded through the Block objects, in eviction
order (least recently freed first), so taking a block, freeing one and pulling a cached block back out
of the middle are all O(1) with no allocation. A freed block keeps its hash, so a later request with the
same prefix can reuse it, until the block is handed out again. Hashes chain (parent hash, token ids)
through SHA-256, so a hit is collision-safe. KV cache groups share the pool; a group past the first keys
its cached blocks by the token hash tagged with the group (`group_key`), so equal tokens in two groups are
two different cached blocks. `NULL_BLOCK` is block 0, reserved as vLLM reserves its null block: never in the
pool (whose blocks are 1..num_blocks), never handed out, never written, its ref count never reaches zero. It
stands in a sliding-window table for a block freed behind the window, and every zero-filled table entry (a freed
row of the input batch, a CUDA graph's padding rows and unused widths, warm-up and capture metadata) points at
its page, so none of them ever reads a sequence's KV. A KV cache for the pool holds `kv_pages(num_blocks)` pages:
page 0 is the null block's.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Iterable, Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


NULL_BLOCK = Block(0)  # page 0, reserved: table filler where a window group freed a block (attention masks those)
NULL_BLOCK.ref_count = 1 << 62  # touch/free by forks and frees move it up and down, never to zero
NULL_BLOCK.block_hash = b"null"  # "already hashed": never registered in the prefix cache


def kv_pages(num_blocks: int) -> int:
    """Pages a KV cache for a pool of `num_blocks` blocks holds: the blocks' (ids 1..num_blocks) and page 0."""
    return num_blocks + 1


def group_key(block_hash: bytes, group: int) -> bytes:
    """A cached block's key in the pool: group 0 uses the token hash itself (single-group models pay nothing)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; O(1) push, pop and remove."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self.head, self.tail = Block(-1), Block(-2)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not free"
        block.prev_free.next_free, block.next_free.prev_free = block.next_free, block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> Block:
        block = self.head.next_free
        assert block is not self.tail, "no free block"
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], cache_salt: str | None = None,
               extra_keys: Sequence[str] = ()) -> bytes:
    """A full block's key: its tokens chained to its parent's hash. A request's `cache_salt` (vLLM's) seeds
    the chain's root, so only requests with the same salt share cached blocks. `extra_keys` are the content
    hashes of the images whose placeholders the block holds (vLLM's mm_hash): equal placeholder tokens of two
    different images are two different blocks."""
    root = b"root" if cache_salt is None else b"salt:" + cache_salt.encode()
    digest = hashlib.sha256(parent_hash or root)
    digest.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        digest.update(b"mm:" + key.encode())
    return digest.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0
        self.blocks = [Block(i) for i in range(1, num_blocks + 1)]  # block 0 is NULL_BLOCK's, never handed out
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[bytes, Block] = {}
        self.num_cached_free = 0  # free blocks still holding a reusable prefix (kept, not counted, per call)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, including cached ones nobody is using."""
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[Block]:
        assert n <= self.free_queue.num_free, f"asked for {n} blocks with {self.free_queue.num_free} free"
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict the least recently used cached prefix
                self.num_cached_free -= 1
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference to each block (prefix hit or fork); a cached free block leaves the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
                self.num_cached_free -= block.block_hash is not None
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference to each block, in order; a block reaching zero joins the queue's tail."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self.num_cached_free += block.block_hash is not None
                self.free_queue.append(block)

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        """Record that `block` holds the full block with this hash (first writer wins on duplicates)."""
        assert block.block_hash is None
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def uncache_block(self, block: Block) -> None:
        """Forget `block`'s hash (its slots never got their K/V); a duplicate holder of the hash stays canonical."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.num_cached_free = 0
