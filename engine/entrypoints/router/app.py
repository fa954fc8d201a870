"""create_router_app: the public endpoint in front of the engines: the same middlewares, errors and routes.

Auth (API key), the Host check and the body limits (size and JSON shape) are the single-engine server's own
middlewares (engine/entrypoints/openai/auth.py, hosts.py, limits.py), and errors have OpenAI's shape (errors.py). Routes:
GET /health (the router is up), GET /metrics (every engine's, merged with an `engine` label),
GET /v1/models (every servable model: loaded or not, failed with its error, its context and quantization, its
engines), POST /v1/models/{name}/load (a retry for a failed model too), /unload (once the requests in flight
are done, bounded; guarded by the key like every /v1 route), /sleep?level=1|2 and /wake_up (sleep mode, the
state `sleeping`; a request for a sleeping model wakes it), and every other route
relayed to an engine of the model the request names: POSTs by the body's `model` (JIT-loading it), GETs
(the engine-state routes) by `?model=NAME&engine=i`, to a model already loaded. /v1/embeddings goes by its
body's model like any POST. Responses live in the engine that made them: GET and DELETE /v1/responses/{id} and a
POST chaining `previous_response_id` go to that engine's replica, which the router noted from the create
reply (response_directory.py).
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine.config.model import ModelConfig
from engine.entrypoints.router.manager import ModelEntry, ModelManager
from engine.entrypoints.router.metrics_merge import merge_metrics
from engine.entrypoints.router.placement import HOST, model_folder
from engine.entrypoints.router.proxy import make_client, relay
from engine.entrypoints.router.response_directory import ResponseDirectory, ResponseOwner
from engine.entrypoints.openai.auth import ApiKeyMiddleware
from engine.entrypoints.openai.errors import OpenAIError, error_response, install_error_handlers
from engine.entrypoints.openai.hosts import TrustedHostMiddleware, allowed_host_names
from engine.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware

METRICS_TIMEOUT_S = 3.0


def create_router_app(manager: ModelManager, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    config = manager.config
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state["client"] = make_client()
        manager.start_reaper()
        yield
        await manager.shutdown()
        await state["client"].aclose()

    app = FastAPI(title="PagedDesk router", summary="OpenAI-compatible endpoint for several models",
                  version="0.1.0", lifespan=lifespan)
    app.state.manager = manager
    directory = app.state.responses = ResponseDirectory()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(TrustedHostMiddleware, allowed=allowed_host_names(config.host, config.allowed_hosts))
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if manager.stopping:
            return error_response(503, "the server is shutting down", code="shutting_down")
        return JSONResponse({"status": "ok", "models": {n: entry_state(e) for n, e in manager.entries.items()}})

    @app.get("/metrics")
    async def metrics() -> Response:
        ready = [(e, r) for e in manager.entries.values() for r in e.replicas if r.state == "ready"]

        async def scrape(replica) -> str:
            try:
                resp = await state["client"].get(replica.url + "/metrics", timeout=METRICS_TIMEOUT_S)
                return resp.text if resp.status_code == 200 else ""
            except Exception:  # noqa: BLE001 - an engine that just died has no metrics this time
                return ""
        texts = await asyncio.gather(*(scrape(r) for _, r in ready))
        merged = merge_metrics([(str(r.index), e.spec.name, t) for (e, r), t in zip(ready, texts) if t])
        return Response(merged, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(e, created) for e in manager.entries.values()]}

    @app.post("/v1/models/{name:path}/load")
    async def load_model(name: str) -> dict:
        entry = manager.entry(name)
        if entry.replicas and not entry.loaded and not entry.loading:  # failed engines: start afresh
            await manager.unload(entry)
        await manager.load(entry, retry_failed=True)  # a user's load is a retry, whatever failed before
        return model_card(entry, created)

    @app.post("/v1/models/{name:path}/unload")
    async def unload_model(name: str) -> dict:
        entry = manager.entry(name)
        await manager.unload(entry)
        return model_card(entry, created)

    @app.post("/v1/models/{name:path}/sleep")
    async def sleep_model(name: str, level: int = Query(1, ge=1, le=2)) -> dict:
        entry = manager.entry(name)
        await manager.sleep(entry, level)
        return model_card(entry, created)

    @app.post("/v1/models/{name:path}/wake_up")
    async def wake_model(name: str) -> dict:
        entry = manager.entry(name)
        await manager.wake(entry)
        return model_card(entry, created)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def response_by_id(response_id: str, request: Request) -> Response:
        owner = directory.owner(response_id)
        if owner is None:
            raise OpenAIError(404, f"No response with id {response_id!r} is known to this router (it remembers "
                                   f"the engine of the last {directory.capacity} it relayed)", "response_id",
                              "response_not_found")
        entry = manager.entry(owner.model)
        replica = next((r for r in entry.replicas if r.index == owner.replica and r.state == "ready"), None)
        if replica is None:
            raise OpenAIError(404, f"Response {response_id!r} was made by {owner.model}#{owner.replica}, which is "
                                   "no longer running; its stored responses went with it", "response_id",
                              "response_not_found")
        replica.inflight += 1
        reply = await relay(state["client"], request, f"{replica.url}/v1/responses/{response_id}", b"",
                            replica.api_key, f"{entry.spec.name}#{replica.index}",
                            lambda: manager.release(entry, replica, 0), replica.relays)
        if request.method == "DELETE" and reply.status_code == 200:
            directory.forget(response_id)
        return reply

    @app.api_route("/{path:path}", methods=["POST"])
    async def forward_post(path: str, request: Request) -> Response:
        raw = await request.body()
        body = parse_body(raw, len(manager.entries))
        entry = manager.entry(body.get("model") if isinstance(body.get("model"), str) else None)
        creates_response = path == "v1/responses"
        pinned = chained_replica(directory, body, entry.spec.name) if creates_response else None
        replica, tokens = await manager.acquire(entry, body, pinned)
        reply = await relay(state["client"], request, replica.url + "/" + path, raw, replica.api_key,
                            f"{entry.spec.name}#{replica.index}",
                            lambda: manager.release(entry, replica, tokens), replica.relays)
        if creates_response and reply.status_code == 200:
            owner = ResponseOwner(entry.spec.name, replica.index)
            if isinstance(reply, StreamingResponse):
                reply.body_iterator = directory.remember_stream(reply.body_iterator, owner)
            else:
                directory.remember_body(reply.body, owner)
        return reply

    @app.api_route("/{path:path}", methods=["GET"])
    async def forward_get(path: str, request: Request) -> Response:
        if path not in GET_ROUTES:
            raise OpenAIError(404, f"no route GET /{path}")
        entry = manager.entry(request.query_params.get("model"))
        ready = [r for r in entry.replicas if r.state == "ready"]
        if not ready:
            raise OpenAIError(503, f"{entry.spec.name} is not loaded; send it a request or POST "
                                   "/v1/models/NAME/load first", "model", "model_not_loaded")
        index = request.query_params.get("engine", "0")
        replica = next((r for r in ready if str(r.index) == index), None)
        if replica is None:
            raise OpenAIError(400, f"engine must name a running replica of {entry.spec.name}: "
                                   f"{[r.index for r in ready]}", "engine")
        replica.inflight += 1
        return await relay(state["client"], request, replica.url + "/" + path, b"", replica.api_key,
                           f"{entry.spec.name}#{replica.index}", lambda: manager.release(entry, replica, 0),
                           replica.relays)

    return app


GET_ROUTES = ("v1/engine/state", "v1/engine/state/stream")


def chained_replica(directory: ResponseDirectory, body: dict, model: str) -> int | None:
    """The replica holding the conversation a POST /v1/responses continues, if the router relayed its start; a
    conversation is kept by the engine that made it, so continuing it with another model is a 400."""
    previous = body.get("previous_response_id")
    owner = directory.owner(previous) if isinstance(previous, str) else None
    if owner is None:
        return None  # unknown here: the engine answers for it
    if owner.model != model:
        raise OpenAIError(400, f"previous_response_id {previous!r} was created by model `{owner.model}`; its "
                               f"conversation is stored by that model's engine, so continue it with model "
                               f"`{owner.model}` (or resend the earlier turns as input)", "previous_response_id")
    return owner.replica


def parse_body(raw: bytes, num_models: int) -> dict:
    """The JSON body as a dict; with one model an unparsable body still goes to the engine (its 400 says why)."""
    try:
        body = json.loads(raw) if raw else {}
    except (ValueError, UnicodeDecodeError) as exc:
        if num_models == 1:
            return {}
        raise OpenAIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        if num_models == 1:
            return {}
        raise OpenAIError(400, "request body must be a JSON object with a model field")
    return body


def entry_state(entry: ModelEntry) -> str:
    if entry.loading:
        return "loading"
    if entry.loaded:
        return "sleeping" if entry.asleep else "loaded"
    if entry.failure is not None:
        return "failed"
    if any(r.state in ("dead", "failed") for r in entry.replicas):
        return "failed" if all(r.state == "failed" for r in entry.replicas) else "dead"
    return "unloaded"


def model_card(entry: ModelEntry, created: int) -> dict:
    spec = entry.spec
    card: dict[str, Any] = {"id": spec.name, "object": "model", "created": created, "owned_by": "pagedesk",
                            "root": spec.path, "loaded": entry.loaded, "state": entry_state(entry),
                            "data_parallel_size": spec.data_parallel_size, "model_ttl": spec.model_ttl,
                            "model_ttl_action": spec.model_ttl_action,
                            "error": entry.failure.message if entry.failure is not None else None}
    card.update(model_facts(entry))
    card["engines"] = [{"index": r.index, "state": r.state, "pid": r.pid if r.alive() else None,
                        "devices": "cpu" if r.placement.cards == (HOST,) else list(r.placement.cards),
                        "cpu_cores": list(r.placement.cpu_cores) if r.placement.cpu_cores else None,
                        "memory_bytes": r.placement.need.total_bytes, "kv_cache_bytes": r.placement.need.kv_bytes,
                        "outstanding_tokens": r.load.outstanding_tokens, "sleep_level": r.sleep_level,
                        "error": r.error}
                       for r in entry.replicas]
    return card


def model_facts(entry: ModelEntry) -> dict:
    """max_model_len and quantization from the model's config.json (read once), before any engine loads it."""
    if entry.facts is None:
        spec = entry.spec
        try:
            config = spec.engine_config()
            cfg = ModelConfig.from_folder(model_folder(spec), config.quantization)
            cfg.with_max_model_len(config.max_model_len).with_image_limit(config.image_limit())
            quant = cfg.quantization.describe() if cfg.quantization is not None else None
            entry.facts = {"max_model_len": cfg.max_model_len, "context_length": cfg.max_model_len,
                           "quantization": quant,
                           "input_modalities": ["text", "image"] if cfg.vision is not None else ["text"]}
        except (OSError, ValueError, KeyError) as exc:
            return {"max_model_len": None, "context_length": None, "quantization": None, "input_modalities": None,
                    "config_error": str(exc)}
    return entry.facts
