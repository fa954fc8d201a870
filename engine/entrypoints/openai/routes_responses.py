"""POST /v1/responses (OpenAI's Responses API) on the chat path; GET / DELETE /v1/responses/{id} for stored ones.

The request becomes a chat request (responses_input.py) and runs through `start_chat`, so templates,
tools (auto parsed by the tool parser, required / named held by the grammar), text.format's structured
outputs, reasoning parsing and sampling behave exactly as on /v1/chat/completions. One choice's deltas
become output items (output_blocks.py → responses_output.py), whole or as typed SSE events. A response
whose `store` is not false is kept in the context's bounded in-memory ResponseStore, which is what
`previous_response_id` continues from; an id it does not hold is a 400 naming that field.
"""
from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request, Response

from engine.entrypoints.openai.chat_outputs import ChoiceView
from engine.entrypoints.openai.chat_request import reraise_as
from engine.entrypoints.openai.context import ServerContext, get_context
from engine.entrypoints.openai.errors import OpenAIError, bad_request, engine_error, error_type
from engine.entrypoints.openai.generation import close_all, merge, wait_for_finals
from engine.entrypoints.openai.output_blocks import OutputBlocks
from engine.entrypoints.openai.protocol_responses import ResponsesRequest, check_responses_supported
from engine.entrypoints.openai.responses_input import to_chat_request
from engine.entrypoints.openai.responses_output import (ResponseItems, conversation_turn, response_object, usage_object)
from engine.entrypoints.openai.responses_store import StoredResponse
from engine.entrypoints.openai.responses_tools import ResponsesTools
from engine.entrypoints.openai.routes_chat import ChatRun, start_chat
from engine.entrypoints.openai.sse import SSE_RESPONSE_DOC, named_sse_event, sse_response

router = APIRouter()


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _completed_at(status: str) -> int | None:
    return int(time.time()) if status == "completed" else None


def _usage(run: ChatRun, final, reasoning_text: str) -> dict:
    output_tokens = sum(len(o.token_ids) for o in final.outputs)
    reasoning = len(run.model.tokenizer.encode(reasoning_text, add_special_tokens=False)) if reasoning_text else 0
    return usage_object(len(final.prompt_token_ids), final.num_cached_tokens or 0, output_tokens,
                        min(reasoning, output_tokens))


def _reasoning_text(items: ResponseItems) -> str:
    return "".join(p["text"] for item in items.items if item["type"] == "reasoning" for p in item["content"])


def _keep(ctx: ServerContext, req: ResponsesRequest, body: dict, conversation: list[dict]) -> None:
    if req.store is not False:
        ctx.responses.put(body["id"], StoredResponse(body, conversation + conversation_turn(body["output"])))


@router.post("/v1/responses", response_model=None, responses=SSE_RESPONSE_DOC)
async def create_response(req: ResponsesRequest, request: Request,
                          ctx: ServerContext = Depends(get_context)) -> Response | dict:
    check_responses_supported(req)
    history: list[dict] = []
    if req.previous_response_id is not None:
        stored = ctx.responses.get(req.previous_response_id)
        if stored is None:
            raise bad_request(f"previous_response_id {req.previous_response_id!r} names no stored response: the "
                              f"server keeps {ctx.responses.describe()} created without store=false, in memory, "
                              "until it restarts", "previous_response_id")
        history = stored.conversation
    chat, conversation, tools, field = to_chat_request(req, history)
    try:
        run = await start_chat(chat, ctx, id_prefix="resp_")
    except OpenAIError as exc:
        raise reraise_as(exc, field) from None
    if req.max_tool_calls is not None:
        run.plan.max_calls = min(run.plan.max_calls or req.max_tool_calls, req.max_tool_calls)
    if req.stream:
        return sse_response(_stream(req, ctx, run, conversation, tools))
    finals = await wait_for_finals(request, run.streams, ctx.metrics)
    if finals is None:
        return Response(status_code=499)
    final = finals[0]
    out = final.outputs[0]
    view, blocks, items = ChoiceView(run.plan), OutputBlocks(), ResponseItems(tools)
    status = _status(out.finish_reason)
    for ev in blocks.feed(view.update(out.text, final=True)):
        items.render(ev)
    for ev in blocks.finish():
        items.render(ev, status)
    body = response_object(run.request_id, run.created, run.model.name, req, status, items.items,
                           _usage(run, final, _reasoning_text(items)), tools, _completed_at(status))
    _keep(ctx, req, body, conversation)
    return body


async def _stream(req: ResponsesRequest, ctx: ServerContext, run: ChatRun, conversation: list[dict],
                  tools: ResponsesTools) -> AsyncIterator[str]:
    items, blocks, view = ResponseItems(tools), OutputBlocks(), ChoiceView(run.plan)

    def send(event: dict) -> str:
        return named_sse_event(event["type"], event)

    start = response_object(run.request_id, run.created, run.model.name, req, "in_progress", [], None, tools)
    yield send(items.event("response.created", response=start))
    yield send(items.event("response.in_progress", response=start))
    final = None
    try:
        async with aclosing(merge(run.streams, ctx.metrics)) as outputs:
            async for _, out in outputs:
                choice = out.outputs[0]
                events = blocks.feed(view.update(choice.text, choice.finished()))
                for ev in events:
                    for event in items.render(ev):
                        yield send(event)
                if choice.finished():
                    for ev in blocks.finish():
                        for event in items.render(ev, _status(choice.finish_reason)):
                            yield send(event)
                final = out
        status = _status(final.outputs[0].finish_reason)
        body = response_object(run.request_id, run.created, run.model.name, req, status, items.items,
                               _usage(run, final, _reasoning_text(items)), tools, _completed_at(status))
        _keep(ctx, req, body, conversation)
        yield send(items.event(f"response.{status}", response=body))
    except Exception as exc:  # noqa: BLE001 - the stream already started: report the error in-band
        err = engine_error(exc)  # OpenAI's flat fields, and Open Responses' `error` object
        yield send(items.event("error", code=err.code, message=err.message, param=err.param,
                               error={"type": error_type(err.status), "code": err.code, "message": err.message,
                                      "param": err.param}))
    finally:
        close_all(run.streams)


def _stored(ctx: ServerContext, response_id: str) -> StoredResponse:
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise OpenAIError(404, f"No response with id {response_id!r} is stored (the server keeps "
                               f"{ctx.responses.describe()} in memory)", "response_id", "response_not_found")
    return stored


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, ctx: ServerContext = Depends(get_context)) -> dict:
    return _stored(ctx, response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, ctx: ServerContext = Depends(get_context)) -> dict:
    _stored(ctx, response_id)
    ctx.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
