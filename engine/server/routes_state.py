"""GET /v1/engine/state (one snapshot) and GET /v1/engine/state/stream?hz=4 (snapshots as SSE) for the GUI."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response

from engine.server.context import ServerContext, get_context
from engine.server.engine_state import build_state, collect_raw
from engine.server.errors import engine_error, error_body
from engine.server.sse import sse_response

router = APIRouter()


async def snapshot(ctx: ServerContext) -> dict:
    engine = ctx.async_engine
    try:
        raw = await engine.call(collect_raw)
    except Exception as exc:  # noqa: BLE001 - loading/dead become 503
        raise engine_error(exc) from None
    return await asyncio.to_thread(build_state, raw, ctx.served_name, engine.token_rates())


@router.get("/v1/engine/state")
async def engine_state(ctx: ServerContext = Depends(get_context)) -> Response:
    return JSONResponse(await snapshot(ctx))


@router.get("/v1/engine/state/stream")
async def engine_state_stream(hz: float = Query(4.0, ge=0.5, le=20.0),
                              ctx: ServerContext = Depends(get_context)) -> Response:
    ctx.served_model()  # 503 before streaming if the engine is not serving

    async def events():
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                state = await snapshot(ctx)
            except Exception as exc:  # noqa: BLE001 - tell the client why the stream ends
                err = engine_error(exc)
                yield f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n"
                return
            yield f"data: {json.dumps(state, separators=(',', ':'))}\n\n"
            await asyncio.sleep(max(0.0, 1.0 / hz - (loop.time() - started)))

    return sse_response(events())
