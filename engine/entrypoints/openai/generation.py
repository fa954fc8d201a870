"""Run one API request's prompts through the AsyncEngine: start them, merge their streams, watch the client.

A completions request may hold several prompts, each its own engine request (`<id>-<i>`); their
outputs are merged in arrival order. Non-streaming requests poll for a client disconnect so a
vanished client aborts its work at once; streaming ones are cancelled by Starlette when the client
goes away. Every path closes its streams, which aborts whatever has not finished.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request

from engine.entrypoints.async_engine import AsyncEngine, RequestStream
from engine.core.beam_search import BeamSearchParams
from engine.core.outputs import RequestOutput
from engine.sample.pooling import PoolingParams
from engine.sample.sampling_params import SamplingParams
from engine.entrypoints.openai.errors import engine_error
from engine.entrypoints.openai.metrics import ServerMetrics

DISCONNECT_POLL_S = 0.5


async def start_requests(async_engine: AsyncEngine, request_id: str, prompts: list[list[int]],
                         params: list[SamplingParams], cache_salt: str | None = None,
                         beams: list[BeamSearchParams | None] | None = None, priority: int = 0,
                         pooling: PoolingParams | None = None, mms: list | None = None) -> list[RequestStream]:
    """Add every prompt (embedding requests with `pooling`); if the engine refuses one, abort the others and raise
    its error."""
    streams: list[RequestStream] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            beam = beams[i] if beams else None
            mm = mms[i] if mms else None  # a prompt's images (engine/multimodal), processed with its ids
            streams.append(await async_engine.add_request(rid, ids, p, cache_salt=cache_salt, beam=beam,
                                                          priority=priority, pooling=pooling,
                                                          **({"mm": mm} if mm is not None else {})))
    except BaseException:
        close_all(streams)
        raise
    return streams


def close_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.close()


async def merge(streams: list[RequestStream], metrics: ServerMetrics) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) in arrival order, until every stream finished."""
    timers = [metrics.timer() for _ in streams]
    if len(streams) == 1:  # most requests: read the one stream directly, no task and wait per output
        async for out in streams[0]:
            timers[0].on_output(out)
            yield 0, out
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                out = task.result()
                timers[i].on_output(out)
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()


async def final_outputs(streams: list[RequestStream], metrics: ServerMetrics) -> list[RequestOutput]:
    finals: list[Any] = [None] * len(streams)
    async for i, out in merge(streams, metrics):
        finals[i] = out
    return finals


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Await `work` unless the client disconnects first; returns (finished, result)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return True, task.result()
            if await request.is_disconnected():
                return False, None
    finally:
        if not task.done():
            task.cancel()


async def wait_for_finals(request: Request, streams: list[RequestStream],
                          metrics: ServerMetrics) -> list[RequestOutput] | None:
    """Non-streaming: every prompt's final output, or None when the client went away (all work aborted)."""
    try:
        finished, finals = await unless_disconnected(request, final_outputs(streams, metrics))
    except Exception as exc:  # noqa: BLE001 - engine errors become OpenAI-shaped responses
        raise engine_error(exc) from None
    finally:
        close_all(streams)
    return finals if finished else None
