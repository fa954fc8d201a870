"""Which replica of a model serves a request: the one with the fewest outstanding tokens, unless another one
already served the same conversation prefix (its prefix cache holds it).

The router has no tokenizer, so prefixes are compared as text: the request's prompt (a completion's prompt, or
a chat's messages as role and content) is cut into `CHUNK_CHARS`-character chunks and hashed as a chain, each
hash covering everything before it, as the engine's block hashes do. Each replica remembers the chain hashes it
served (bounded, least recently used dropped first); the replica with the longest match wins if its load is
within `BALANCE_TOKENS` of the least loaded one, so one hot conversation cannot pile everything on one
replica. Outstanding tokens are estimated (4 characters a token plus max_tokens) and given back when the
response ends.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

CHUNK_CHARS = 128
MAX_REMEMBERED = 16384  # chain hashes per replica
BALANCE_TOKENS = 4096
CHARS_PER_TOKEN = 4
DEFAULT_MAX_TOKENS = 256


@dataclass
class ReplicaLoad:
    outstanding_tokens: int = 0
    num_requests: int = 0  # served so far: breaks ties so idle replicas take turns
    prefixes: OrderedDict = field(default_factory=OrderedDict)

    def remember(self, chain: list[bytes]) -> None:
        for h in chain:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > MAX_REMEMBERED:
            self.prefixes.popitem(last=False)

    def matched_chunks(self, chain: list[bytes]) -> int:
        n = 0
        for h in chain:
            if h not in self.prefixes:
                break
            n += 1
        return n


def prompt_text(body: dict[str, Any]) -> str:
    """The text a request's prompt starts with, in the order the engine would see it."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for message in body["messages"]:
            if isinstance(message, dict):
                content = message.get("content")
                text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
                parts.append(f"{message.get('role')}\x00{text}\x01")
        return "".join(parts)
    prompt = body.get("prompt", body.get("input", ""))
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def prefix_chain(text: str) -> list[bytes]:
    """Chained hashes of the full CHUNK_CHARS chunks of `text` (a partial last chunk is left out, like an
    unfilled KV block)."""
    chain, parent = [], b""
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = hashlib.blake2b(parent + text[start:start + CHUNK_CHARS].encode("utf-8", "surrogatepass"),
                                 digest_size=16).digest()
        chain.append(parent)
    return chain


def estimate_tokens(body: dict[str, Any], text: str) -> int:
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    return len(text) // CHARS_PER_TOKEN + int(max_tokens if isinstance(max_tokens, int) else DEFAULT_MAX_TOKENS) * n


def choose_replica(loads: list[ReplicaLoad], chain: list[bytes]) -> int:
    """The index of the replica to send to; `loads` are the replicas able to serve now."""
    assert loads, "no replica to choose from"
    least = min(range(len(loads)), key=lambda i: (loads[i].outstanding_tokens, loads[i].num_requests, i))
    if chain:
        matches = [loads[i].matched_chunks(chain) for i in range(len(loads))]
        best = max(range(len(loads)), key=lambda i: (matches[i], -loads[i].outstanding_tokens, -i))
        if matches[best] and loads[best].outstanding_tokens <= loads[least].outstanding_tokens + BALANCE_TOKENS:
            return best
    return least
