"""Sleep mode over HTTP, vLLM's routes: POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping.

Level 1 moves the weights to host RAM and drops the KV cache; level 2 drops both and reloads the weights from the
checkpoint on wake (EngineCore.sleep). Requests that arrive while the engine sleeps are accepted and wait, unsent
to the model, until /wake_up (vLLM's behaviour: no 503); a client that cannot wait sets its own timeout. Behind the
API key like every other route. Left out of /openapi.json: they are operator controls, not part of the OpenAI
API a client generator or a schema fuzzer should call (vLLM hides them behind its dev mode).
"""
from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from engine.entrypoints.openai.context import ServerContext, get_context
from engine.entrypoints.openai.errors import engine_error

router = APIRouter(include_in_schema=False)


async def _call(ctx: ServerContext, fn):
    try:
        return await ctx.async_engine.call(fn, refresh_stats=True)
    except Exception as exc:  # noqa: BLE001 - loading/dead become 503, a bad level 400
        raise engine_error(exc) from None


@router.post("/sleep")
async def sleep(level: int = Query(1, ge=1, le=2), ctx: ServerContext = Depends(get_context)) -> dict:
    freed = await _call(ctx, lambda engine: engine.sleep(level))
    return {"is_sleeping": True, "level": level, "freed_bytes": freed}


@router.post("/wake_up")
async def wake_up(ctx: ServerContext = Depends(get_context)) -> dict:
    await _call(ctx, lambda engine: engine.wake_up())
    ctx.async_engine.wake()  # the engine thread looks at the waiting requests now, not after its idle wait
    return {"is_sleeping": False}


@router.get("/is_sleeping")
async def is_sleeping(ctx: ServerContext = Depends(get_context)) -> dict:
    return {"is_sleeping": await _call(ctx, lambda engine: engine.is_sleeping)}
