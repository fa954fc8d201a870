"""GET /v1/engine/state (one snapshot) and GET /v1/engine/state/stream?hz=4 (snapshots as SSE) for the GUI.

Every reader goes through the server's SnapshotHub, so many subscribers cost the engine no more than one.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from engine.entrypoints.openai.context import ServerContext, get_context
from engine.entrypoints.openai.engine_state import ExpertLoadInterval, build_state, collect_raw
from engine.entrypoints.openai.errors import engine_error, error_body
from engine.entrypoints.openai.sse import EventStreamResponse, sse_response
from engine.entrypoints.openai.state_hub import MAX_SNAPSHOTS_PER_S, SnapshotHub

router = APIRouter()


async def snapshot(ctx: ServerContext, expert_load: ExpertLoadInterval | None = None) -> dict:
    engine = ctx.async_engine
    try:
        raw = await engine.call(collect_raw)
    except Exception as exc:  # noqa: BLE001 - loading/dead become 503
        raise engine_error(exc) from None
    return await asyncio.to_thread(build_state, raw, ctx.served_name, engine.token_rates(), expert_load)


async def _encoded_snapshot(ctx: ServerContext, expert_load: ExpertLoadInterval) -> str:
    return json.dumps(await snapshot(ctx, expert_load), separators=(",", ":"))


def snapshot_hub(ctx: ServerContext) -> SnapshotHub:
    if ctx.snapshots is None:
        expert_load = ExpertLoadInterval()  # one per hub: its documents are the intervals' ends
        ctx.snapshots = SnapshotHub(lambda: _encoded_snapshot(ctx, expert_load))
    return ctx.snapshots


@router.get("/v1/engine/state", responses={200: {"content": {"application/json": {"schema": {"type": "object"}}},
                                                  "description": "One snapshot (docs/engine-state.md)"}})
async def engine_state(ctx: ServerContext = Depends(get_context)) -> Response:
    hub = snapshot_hub(ctx)
    snap = await hub.get(started_after=hub.now())  # the state as of this request, not one a stream took earlier
    return Response(snap.body, media_type="application/json")


@router.get("/v1/engine/state/stream", response_class=EventStreamResponse,
            responses={200: {"description": "Snapshots as server-sent events"}})
async def engine_state_stream(hz: float = Query(4.0, ge=0.5, le=MAX_SNAPSHOTS_PER_S, allow_inf_nan=False),
                              ctx: ServerContext = Depends(get_context)) -> Response:
    ctx.served_model()  # 503 before streaming if the engine is not serving
    hub = snapshot_hub(ctx)

    async def events():
        loop = asyncio.get_running_loop()
        seen = 0
        hub.subscribers += 1
        try:
            while True:
                started = loop.time()
                try:
                    snap = await hub.get(seen)
                    seen = snap.seq
                except Exception as exc:  # noqa: BLE001 - tell the client why the stream ends
                    err = engine_error(exc)
                    yield f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n"
                    return
                yield f"data: {snap.body}\n\n"
                await asyncio.sleep(max(0.0, hub.interval(hz) - (loop.time() - started)))
        finally:
            hub.subscribers -= 1

    return sse_response(events())
