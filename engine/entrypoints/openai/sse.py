"""Server-sent events: one `data: {json}` event per chunk, `data: [DONE]` at the end of OpenAI chat and completion
streams; named events (`event: <type>`) for the Responses and Anthropic Messages streams, which end without it."""
from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def sse_event(data: BaseModel | dict, exclude: set[str] | None = None) -> str:
    """One `data:` event; a model is serialised by pydantic straight to JSON (`exclude`: its fields left out)."""
    body = (data.model_dump_json(exclude=exclude) if isinstance(data, BaseModel)
            else json.dumps(data, separators=(",", ":")))
    return f"data: {body}\n\n"


def named_sse_event(event: str, data: dict) -> str:
    """An event with its type on the `event:` line too, as the Responses and Anthropic streams send them."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


# What /openapi.json says a streaming route answers (merged into the route's JSON 200 where it has one).
SSE_RESPONSE_DOC = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                          "description": "JSON, or with stream=true server-sent events ending with data: [DONE]"}}


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return EventStreamResponse(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
