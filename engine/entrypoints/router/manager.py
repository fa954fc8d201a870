"""ModelManager: which engines run, for which model, on which cards; JIT loading, TTL and LRU unloading, restarts.

A model is "loaded" when its replicas' engines run. A request for a model that is not loaded loads it and waits
(placement first, under one lock so two loads never book the same memory; the slow engine start-up outside it).
When a model does not fit, idle models are unloaded least recently used first (`placement.place`); when it
cannot fit even then, the request gets a 503 naming the missing memory. A replica found dead is restarted on
the next request for its model, after its backoff; while a sibling replica serves, requests go there. The
reaper task unloads models idle past their TTL and notices engines that died between requests.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from engine.entrypoints.router.backend import EngineProcess, LoadFailed
from engine.entrypoints.router.balancer import choose_replica, estimate_tokens, prefix_chain, prompt_text
from engine.entrypoints.router.placement import Card, Holder, NoRoom, place
from engine.entrypoints.router.specs import ModelSpec, RouterConfig
from engine.entrypoints.openai.errors import OpenAIError

log = logging.getLogger("pagedesk.router")
LOAD_TIMEOUT_S = 900.0
REAP_INTERVAL_S = 0.5


@dataclass
class ModelEntry:
    spec: ModelSpec
    replicas: list[EngineProcess] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    loading: bool = False
    facts: dict | None = None  # max_model_len, quantization (app.model_facts)

    @property
    def loaded(self) -> bool:
        return bool(self.replicas) and any(r.state == "ready" for r in self.replicas)

    @property
    def inflight(self) -> int:
        return sum(r.inflight for r in self.replicas)

    def holder(self) -> Holder:
        held: dict[int, int] = {}
        for r in self.replicas:
            for card in r.placement.cards:
                held[card] = held.get(card, 0) + r.placement.need.total_bytes
        return Holder(self.spec.name, held, idle=not self.loading and self.inflight == 0, last_used=self.last_used)


class ModelManager:
    def __init__(self, config: RouterConfig, cards: list[Card]):
        self.config, self.cards = config, cards
        self.entries = {name: ModelEntry(spec) for name, spec in config.models.items()}
        self.place_lock = asyncio.Lock()
        self.stopping = False
        self._reaper: asyncio.Task | None = None

    def start_reaper(self) -> None:
        self._reaper = asyncio.create_task(self._reap())

    def entry(self, name: str | None) -> ModelEntry:
        if name is None:
            if len(self.entries) == 1:
                return next(iter(self.entries.values()))
            raise OpenAIError(400, f"model is required: this server serves {len(self.entries)} models "
                                   "(GET /v1/models lists them)", "model")
        entry = self.entries.get(name)
        if entry is None:
            raise OpenAIError(404, f"The model `{name}` does not exist; served: {', '.join(sorted(self.entries))}",
                              "model", "model_not_found")
        return entry

    async def load(self, entry: ModelEntry) -> None:
        """Start the model's engines if they are not running (JIT); 503 when it cannot fit or fails to load."""
        if self.stopping:
            raise OpenAIError(503, "the server is shutting down", code="shutting_down")
        async with entry.lock:
            if entry.replicas:
                return
            entry.loading = True
            try:
                async with self.place_lock:
                    others = [e.holder() for e in self.entries.values() if e is not entry and e.replicas]
                    try:
                        placements, evict = place(entry.spec, self.cards, others, self.config.max_loaded_models)
                    except NoRoom as exc:
                        raise OpenAIError(503, str(exc), "model", "insufficient_memory") from None
                    except (ValueError, OSError) as exc:
                        raise OpenAIError(503, f"cannot load {entry.spec.name}: {exc}", "model",
                                          "model_load_failed") from None
                    for name in evict:
                        log.info("unloading %s (least recently used idle model) to make room for %s",
                                 name, entry.spec.name)
                        async with self.entries[name].lock:  # never a loading one: those are not idle
                            await self._stop_entry(self.entries[name])
                    entry.replicas = [EngineProcess(entry.spec, i, p) for i, p in enumerate(placements)]
                await self._start_replicas(entry, entry.replicas)
            finally:
                entry.loading = False
                entry.last_used = time.monotonic()

    async def _start_replicas(self, entry: ModelEntry, replicas: list[EngineProcess]) -> None:
        results = await asyncio.gather(*(r.start(LOAD_TIMEOUT_S) for r in replicas), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and not any(r.state == "ready" for r in entry.replicas):
            await self._stop_entry(entry)
            raise OpenAIError(503, str(errors[0]), "model", "model_load_failed")
        for error in errors:  # a replica that failed while a sibling serves: restarted on a later request
            log.warning("%s: a replica did not start: %s", entry.spec.name, error)

    async def unload(self, entry: ModelEntry) -> None:
        async with entry.lock:
            await self._stop_entry(entry)

    async def _stop_entry(self, entry: ModelEntry) -> None:
        stopped = [(r.index, r.pid) for r in entry.replicas]
        await asyncio.gather(*(r.stop() for r in entry.replicas))
        for index, pid in stopped:  # in the engines' own "[NAME#i]" prefix: the app files it in that model's log
            log.info("[%s#%d] unloaded (engine pid %s stopped)", entry.spec.name, index, pid)
        entry.replicas = []

    async def acquire(self, entry: ModelEntry, body: dict, replica_index: int | None = None
                      ) -> tuple[EngineProcess, int]:
        """A ready replica for this request (loading or restarting as needed), with the tokens it is charged;
        `replica_index` pins it to that replica while it is ready (a chained response lives there)."""
        await self.load(entry)
        ready = [r for r in entry.replicas if r.state == "ready" and r.alive()]
        dead = [r for r in entry.replicas if r.state == "dead"]
        if dead and not self.stopping:
            restart = self._restart(entry, dead)
            if ready:
                asyncio.create_task(restart)  # siblings serve meanwhile
            else:
                await restart
                ready = [r for r in entry.replicas if r.state == "ready" and r.alive()]
        if not ready:
            failed = next((r.error for r in entry.replicas if r.error), None)
            raise OpenAIError(503, failed or f"{entry.spec.name}: no engine is serving", "model", "engine_dead")
        text = prompt_text(body)
        chain = prefix_chain(text)
        pinned = [r for r in ready if r.index == replica_index]
        replica = pinned[0] if pinned else ready[choose_replica([r.load for r in ready], chain)]
        tokens = estimate_tokens(body, text)
        replica.load.outstanding_tokens += tokens
        replica.load.num_requests += 1
        replica.load.remember(chain)
        replica.inflight += 1
        entry.last_used = time.monotonic()
        return replica, tokens

    async def _restart(self, entry: ModelEntry, dead: list[EngineProcess]) -> None:
        async with entry.lock:
            todo = [r for r in dead if r.state == "dead" and r in entry.replicas]
            for r in todo:
                await r.stop(grace_s=1)  # reap the old group
            results = await asyncio.gather(*(r.start(LOAD_TIMEOUT_S) for r in todo), return_exceptions=True)
            for r, result in zip(todo, results):
                if isinstance(result, LoadFailed):
                    log.warning("%s#%d: restart failed: %s", entry.spec.name, r.index, result)

    def release(self, entry: ModelEntry, replica: EngineProcess, tokens: int) -> None:
        replica.load.outstanding_tokens = max(0, replica.load.outstanding_tokens - tokens)
        replica.inflight = max(0, replica.inflight - 1)
        entry.last_used = time.monotonic()

    def check_exits(self) -> None:
        for entry in self.entries.values():
            for r in entry.replicas:
                if r.state == "ready" and not r.alive():
                    r.note_exit()

    async def _reap(self) -> None:
        while not self.stopping:
            await asyncio.sleep(REAP_INTERVAL_S)
            self.check_exits()
            now = time.monotonic()
            for entry in self.entries.values():
                ttl = entry.spec.model_ttl
                if ttl is None or not entry.replicas or entry.loading or entry.inflight:
                    continue
                if now - entry.last_used >= ttl and not entry.lock.locked():
                    log.info("unloading %s: idle for %.0f s (model TTL %.0f s)", entry.spec.name,
                             now - entry.last_used, ttl)
                    await self.unload(entry)

    def signal_all(self, sig: int) -> None:
        """Signal every engine's process group now (from a signal handler, or the last sweep at exit)."""
        for entry in self.entries.values():
            for r in entry.replicas:
                r.signal(sig)

    async def shutdown(self) -> None:
        """Stop every engine (SIGTERM: their streams end in-band), then make sure none is left."""
        self.stopping = True
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(r.stop() for e in self.entries.values() for r in e.replicas),
                             return_exceptions=True)
        for e in self.entries.values():
            e.replicas = []
