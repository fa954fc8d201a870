"""ModelManager: which engines run, for which model, on which cards; JIT loading, TTL and LRU unloading, restarts.

A model is "loaded" when its replicas' engines run. A request for a model that is not loaded loads it and waits
(placement first, under one lock so two loads never book the same memory; the slow engine start-up outside it).
When a model does not fit, idle models are unloaded least recently used first (`placement.place`); when it
cannot fit even then, the request gets a 503 naming the missing memory. A model that fails to load is kept as
failed (load_failures.py) and answered at once until its folder changes or a backoff expires. Unloading
(explicit, LRU or idle TTL) first lets the requests in flight finish, for at most DRAIN_TIMEOUT_S; whatever is
still running then ends with "model NAME was unloaded". A replica found dead is restarted on the next request
for its model, after its backoff; while a sibling replica serves, requests go there. One replica that stops
answering its liveness probe (liveness.py) is killed, its requests failed in-band, and restarted. The reaper
task unloads models idle past their TTL and notices engines that died between requests. On the host, what an
engine process holds before any tensor is measured from the engines that run and counted for the next ones.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field

from engine.entrypoints.router.backend import EngineProcess, LoadFailed
from engine.entrypoints.router.balancer import choose_replica, estimate_tokens, prefix_chain, prompt_text
from engine.entrypoints.router.liveness import watch_liveness
from engine.entrypoints.router.load_failures import LoadFailure, folder_fingerprint
from engine.entrypoints.router.placement import CPU_PROCESS_BYTES, HOST, Card, Holder, NoRoom, place
from engine.entrypoints.router.specs import ModelSpec, RouterConfig
from engine.entrypoints.openai.errors import OpenAIError

log = logging.getLogger("pagedesk.router")
LOAD_TIMEOUT_S = 900.0
REAP_INTERVAL_S = 0.5
DRAIN_TIMEOUT_S = 30.0  # an unload waits this long for the requests in flight


@dataclass
class ModelEntry:
    spec: ModelSpec
    replicas: list[EngineProcess] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    loading: bool = False
    unloading: bool = False  # draining: new requests wait for the unload, then load it again
    failure: LoadFailure | None = None  # the last load failed; kept until the folder changes or it expires
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
    def __init__(self, config: RouterConfig, cards: list[Card], failures: dict[str, str] | None = None):
        """`failures`: models found broken at start ({name: message}); they are served as failed."""
        self.config, self.cards = config, cards
        self.entries = {name: ModelEntry(spec) for name, spec in config.models.items()}
        for name, message in (failures or {}).items():
            self._remember_failure(self.entries[name], message)
        self.place_lock = asyncio.Lock()
        self.stopping = False
        self.process_bytes = CPU_PROCESS_BYTES  # an engine process's baseline on the host, once measured
        self._measured = False
        self._tasks: list[asyncio.Task] = []

    def start_reaper(self) -> None:
        self._tasks = [asyncio.create_task(self._reap()),
                       asyncio.create_task(watch_liveness(self._serving, self._hung, lambda: self.stopping))]

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

    async def load(self, entry: ModelEntry, retry_failed: bool = False) -> None:
        """Start the model's engines if they are not running (JIT); 503 when it cannot fit or fails to load, at
        once while an earlier failure holds (`retry_failed`: try anyway, as an explicit load does)."""
        if self.stopping:
            raise OpenAIError(503, "the server is shutting down", code="shutting_down")
        if entry.replicas and not entry.unloading:
            return
        async with entry.lock:
            if entry.replicas:
                return
            if entry.failure is not None and not retry_failed and \
                    entry.failure.holds(folder_fingerprint(entry.spec.path), time.monotonic()):
                raise OpenAIError(503, entry.failure.message, "model", "model_load_failed")
            entry.loading = True
            try:
                async with self.place_lock:
                    others = [e.holder() for e in self.entries.values() if e is not entry and e.replicas]
                    try:
                        placements, evict = place(entry.spec, self.cards, others, self.config.max_loaded_models,
                                                  self.process_bytes)
                    except NoRoom as exc:
                        raise OpenAIError(503, str(exc), "model", "insufficient_memory") from None
                    except (ValueError, OSError) as exc:
                        raise self._remember_failure(entry, f"cannot load {entry.spec.name}: {exc}") from None
                    for name in evict:
                        log.info("unloading %s (least recently used idle model) to make room for %s",
                                 name, entry.spec.name)
                        async with self.entries[name].lock:  # never a loading one: those are not idle
                            await self._drain_and_stop(self.entries[name], f"to make room for {entry.spec.name}")
                    entry.replicas = [EngineProcess(entry.spec, i, p) for i, p in enumerate(placements)]
                await self._start_replicas(entry, entry.replicas)
                entry.failure = None
            finally:
                entry.loading = False
                entry.last_used = time.monotonic()

    def _remember_failure(self, entry: ModelEntry, message: str) -> OpenAIError:
        """Keep the failure (and the folder it failed with); the 503 every request gets while it holds."""
        entry.failure = LoadFailure.after(entry.failure, message, folder_fingerprint(entry.spec.path),
                                          time.monotonic())
        log.warning("%s failed to load: %s (answered at once until its folder changes or %.0f s pass)",
                    entry.spec.name, message, entry.failure.retry_at - time.monotonic())
        return OpenAIError(503, message, "model", "model_load_failed")

    async def _start_replicas(self, entry: ModelEntry, replicas: list[EngineProcess]) -> None:
        results = await asyncio.gather(*(r.start(LOAD_TIMEOUT_S) for r in replicas), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and not any(r.state == "ready" for r in entry.replicas):
            await self._stop_entry(entry)
            raise self._remember_failure(entry, str(errors[0]))
        for error in errors:  # a replica that failed while a sibling serves: restarted on a later request
            log.warning("%s: a replica did not start: %s", entry.spec.name, error)
        self._measure_process_bytes([r for r in replicas if r.state == "ready"])

    def _measure_process_bytes(self, replicas: list[EngineProcess]) -> None:
        """What an engine process holds on the host beyond its weights and KV cache, from the engines that just
        started there (the largest seen); placement counts it for every later engine."""
        for r in replicas:
            rss = r.rss_bytes() if r.placement.cards == (HOST,) else None
            if rss is None:
                continue
            need = r.placement.need
            measured = max(0, rss - need.weights_bytes - need.kv_bytes)
            self.process_bytes = measured if not self._measured else max(self.process_bytes, measured)
            self._measured = True
            log.info("an engine process on the host holds %.0f MiB besides its weights and KV cache (%s#%d "
                     "measured); placement counts %.0f MiB per engine process", measured / 2**20, r.spec.name,
                     r.index, self.process_bytes / 2**20)

    async def unload(self, entry: ModelEntry, why: str = "POST /v1/models/NAME/unload") -> None:
        async with entry.lock:
            await self._drain_and_stop(entry, why)

    async def _drain_and_stop(self, entry: ModelEntry, why: str) -> None:
        """Wait (at most DRAIN_TIMEOUT_S) for the requests in flight, cut the rest with the reason, stop the
        engines. Called with entry.lock held, so no new request starts meanwhile."""
        if not entry.replicas:
            return
        entry.unloading = True
        try:
            busy = sum(r.relays.num_requests for r in entry.replicas)
            if busy:
                log.info("unloading %s (%s): waiting up to %.0f s for %d request(s) in flight", entry.spec.name,
                         why, DRAIN_TIMEOUT_S, busy)
                try:
                    await asyncio.wait_for(asyncio.gather(*(r.relays.requests_done() for r in entry.replicas)),
                                           DRAIN_TIMEOUT_S)
                except TimeoutError:
                    pass
            message = f"model {entry.spec.name} was unloaded ({why}) before this request finished"
            cut = sum(r.relays.cut(message, "model_unloaded") for r in entry.replicas)
            if cut:
                log.info("unloading %s: %d relay(s) cut", entry.spec.name, cut)
            await self._stop_entry(entry)
        finally:
            entry.unloading = False

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
        self.check_exits()  # a replica that exited since the last reap is dead now, so it is restarted below
        ready = [r for r in entry.replicas if r.state == "ready" and r.alive()]
        dead = [r for r in entry.replicas if r.state == "dead"]
        if ready and dead and not self.stopping:
            asyncio.create_task(self._restart(entry, dead))  # siblings serve meanwhile
        elif not ready and not self.stopping:
            await self._restart(entry, dead)  # the lock: also waits for a load or restart in progress
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

    def _serving(self) -> list[tuple[ModelEntry, EngineProcess]]:
        return [(e, r) for e in self.entries.values() for r in e.replicas if r.state == "ready" and r.alive()]

    def _hung(self, entry: ModelEntry, replica: EngineProcess, silent_s: float) -> None:
        """An engine that stopped answering: its requests end in-band now, its group is killed (a stopped
        process cannot act on SIGTERM), and it restarts (after its backoff)."""
        message = (f"{entry.spec.name}: engine #{replica.index} (pid {replica.pid}) stopped answering for "
                   f"{silent_s:.0f} s (hung or stopped); its requests were failed and it is being restarted")
        log.warning(message)
        replica.relays.cut(message, "engine_dead")
        replica.signal(signal.SIGKILL)
        replica.note_hung(message)
        if not self.stopping:
            asyncio.create_task(self._restart(entry, [replica]))

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
                    await self.unload(entry, f"idle for {now - entry.last_used:.0f} s")

    def signal_all(self, sig: int) -> None:
        """Signal every engine's process group now (from a signal handler, or the last sweep at exit)."""
        for entry in self.entries.values():
            for r in entry.replicas:
                r.signal(sig)

    async def shutdown(self) -> None:
        """Stop every engine (SIGTERM: their streams end in-band), then make sure none is left."""
        self.stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(r.stop() for e in self.entries.values() for r in e.replicas),
                             return_exceptions=True)
        for e in self.entries.values():
            e.replicas = []
