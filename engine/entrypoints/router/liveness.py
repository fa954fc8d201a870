"""Liveness of the engines behind the router: a short GET /health to every serving engine each second.

A stopped or hung engine (SIGSTOPped, stuck in a system call, its event loop blocked) keeps its port open, so
a request relayed to it would wait as long as the router lets it, which for a stream is forever (it sets no
read timeout: a stream may wait long for its first token). Any HTTP answer counts as alive, a 503 too (the
engine is up and says why; it exits by itself when it died). An engine that has not answered for
HUNG_AFTER_S is hung: `watch_liveness` hands it to the manager, which fails its requests in-band, kills its
process group and restarts it. A stopped engine is seen within HUNG_AFTER_S + PROBE_INTERVAL_S (9 s).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import httpx

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 3.0
HUNG_AFTER_S = 8.0  # several probes unanswered: a slow machine is not a hung engine


async def answers(client: httpx.AsyncClient, url: str) -> bool:
    try:
        await client.get(url + "/health", timeout=PROBE_TIMEOUT_S)
        return True
    except httpx.HTTPError:
        return False


async def watch_liveness(serving: Callable[[], list], on_hung: Callable[[object, object, float], None],
                         stopping: Callable[[], bool]) -> None:
    """Probe every (entry, replica) `serving()` names, each PROBE_INTERVAL_S, until `stopping()`; a replica
    unanswered for HUNG_AFTER_S since its `last_answer` goes to `on_hung(entry, replica, silent_seconds)`."""
    async with httpx.AsyncClient() as client:
        while not stopping():
            await asyncio.sleep(PROBE_INTERVAL_S)
            probed = serving()
            answered = await asyncio.gather(*(answers(client, replica.url) for _, replica in probed))
            now = time.monotonic()
            for (entry, replica), ok in zip(probed, answered):
                if ok:
                    replica.last_answer = now
                elif replica.state == "ready" and now - replica.last_answer >= HUNG_AFTER_S:
                    on_hung(entry, replica, now - replica.last_answer)
