"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, on the chat path.

The request becomes a chat request (messages_input.py) and runs through `start_chat`, so the template,
tools, grammar-forced calls and reasoning parsing are the chat route's own; the reply's blocks
(output_blocks.py) become Anthropic content blocks, whole or as Anthropic's SSE events
(messages_output.py); a stream's message_start goes out with the first engine output, so its usage shows the
prefix-cache hit. Errors on these routes use Anthropic's error shape (errors.py), in-band as an `error` event
once a stream started; the API key may come as `x-api-key` (auth.py).
"""
from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request, Response

from engine.entrypoints.openai.chat_outputs import ChoiceView
from engine.entrypoints.openai.chat_request import reraise_as
from engine.entrypoints.openai.context import ServerContext, get_context
from engine.entrypoints.openai.errors import OpenAIError, anthropic_error_body, engine_error
from engine.entrypoints.openai.generation import close_all, merge, wait_for_finals
from engine.entrypoints.openai.messages_input import messages_field, to_chat_request
from engine.entrypoints.openai.messages_output import block_events, content_block, message_object, stop_reason, usage
from engine.entrypoints.openai.output_blocks import OutputBlocks
from engine.entrypoints.openai.prompts import renders_system_anywhere
from engine.entrypoints.openai.protocol_messages import CountTokensRequest, MessagesRequest
from engine.entrypoints.openai.routes_chat import ChatRun, output_plan, render_prompt, start_chat
from engine.entrypoints.openai.sse import SSE_RESPONSE_DOC, named_sse_event, sse_response

router = APIRouter()


@router.post("/v1/messages", response_model=None, responses=SSE_RESPONSE_DOC)
async def create_message(req: MessagesRequest, request: Request,
                         ctx: ServerContext = Depends(get_context)) -> Response | dict:
    chat = to_chat_request(req, renders_system_anywhere(ctx.model_for(req.model)))
    try:
        run = await start_chat(chat, ctx, id_prefix="msg_")
    except OpenAIError as exc:
        raise reraise_as(exc, messages_field) from None
    if req.stream:
        return sse_response(_stream(ctx, run))
    finals = await wait_for_finals(request, run.streams, ctx.metrics)
    if finals is None:
        return Response(status_code=499)
    final, out = finals[0], finals[0].outputs[0]
    view, blocks = ChoiceView(run.plan), OutputBlocks()
    blocks.feed(view.update(out.text, final=True))
    reason, sequence = stop_reason(out.finish_reason, out.stop_reason, bool(view.calls))
    return message_object(run.request_id, run.model.name, [content_block(b) for b in blocks.blocks], reason,
                          sequence, usage(len(final.prompt_token_ids), len(out.token_ids),
                                          final.num_cached_tokens or 0))


async def _stream(ctx: ServerContext, run: ChatRun) -> AsyncIterator[str]:
    def send(event: dict) -> str:
        return named_sse_event(event["type"], event)

    view, blocks = ChoiceView(run.plan), OutputBlocks()
    try:
        final = None
        async with aclosing(merge(run.streams, ctx.metrics)) as outputs:
            async for _, out in outputs:
                if final is None:  # sent with the first output, which knows the prefix-cache hit (as vLLM does)
                    use = usage(run.prompt_tokens, 0, out.num_cached_tokens or 0)
                    yield send({"type": "message_start",
                                "message": message_object(run.request_id, run.model.name, [], None, None, use)})
                    yield send({"type": "ping"})
                choice = out.outputs[0]
                events = blocks.feed(view.update(choice.text, choice.finished()))
                for ev in events + (blocks.finish() if choice.finished() else []):
                    for event in block_events(ev):
                        yield send(event)
                final = out
        choice = final.outputs[0]
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, bool(view.calls))
        use = usage(len(final.prompt_token_ids), len(choice.token_ids), final.num_cached_tokens or 0)
        yield send({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": use})
        yield send({"type": "message_stop"})
    except Exception as exc:  # noqa: BLE001 - the stream already started: report the error in-band
        err = engine_error(exc)
        yield send(anthropic_error_body(err.status, err.message))
    finally:
        close_all(run.streams)


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, ctx: ServerContext = Depends(get_context)) -> dict:
    """The prompt's tokens as /v1/messages would render it (tools and system included)."""
    model = ctx.model_for(req.model)
    chat = to_chat_request(req, renders_system_anywhere(model))
    try:
        _, forced_schema = output_plan(chat, model)
        prompt = await render_prompt(chat, model, forced_schema is not None)
    except OpenAIError as exc:
        raise reraise_as(exc, messages_field) from None
    return {"input_tokens": len(prompt.token_ids)}
