"""POST /v1/chat/completions: messages → chat template → one engine request with n choices, whole or as SSE.

Streams follow OpenAI's chunk order: a role chunk per choice, content deltas, a finish chunk per
choice, then (with stream_options.include_usage) a usage chunk with no choices, then `[DONE]`.
Tool definitions are passed to templates that support them; tool calls are returned as plain text.
"""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request, Response

from engine.async_engine import RequestStream
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import MAX_LOGPROBS
from engine.server.context import ServerContext, get_context
from engine.server.errors import bad_request, engine_error, stream_error_event
from engine.server.generation import close_all, merge, start_requests, wait_for_finals
from engine.server.logprobs import chat_logprobs
from engine.server.prompts import chat_prompt, message_chars, resolve_max_tokens
from engine.server.protocol import ChatCompletionRequest
from engine.server.responses import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                     ChatLogprobs, ChatMessageOut, DeltaMessage, Usage)
from engine.server.sampling import sampling_params
from engine.server.served_model import ServedModel
from engine.server.sse import DONE, SSE_RESPONSE_DOC, sse_event, sse_response
from engine.server.tokenize_pool import off_loop

router = APIRouter()


def _check_supported(req: ChatCompletionRequest) -> int | None:
    """Refuse what is not built; return the engine's logprobs count (None: off)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}", "top_logprobs")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request(f"response_format {req.response_format.get('type')!r} is not supported yet; only "
                          "'text'", "response_format")
    if req.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice other than 'none' or 'auto' is not supported yet", "tool_choice")
    return (req.top_logprobs or 0) if req.logprobs else None


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=SSE_RESPONSE_DOC)
async def create_chat_completion(req: ChatCompletionRequest, request: Request,
                                 ctx: ServerContext = Depends(get_context)) -> Response | ChatCompletionResponse:
    model = ctx.model_for(req.model)
    logprobs = _check_supported(req)
    prompt = await off_loop(message_chars(req.messages), chat_prompt, model, req.messages, req.tools,
                            req.add_generation_prompt, req.continue_final_message)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(requested, len(prompt.token_ids), model.max_model_len, param)
    params = sampling_params(req, max_tokens, logprobs, model.vocab_size)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        streams = await start_requests(ctx.async_engine, request_id, [prompt.token_ids], [params])
    except Exception as exc:  # noqa: BLE001
        raise engine_error(exc) from None
    created = int(time.time())
    if req.stream:
        return sse_response(_stream(req, ctx, model, streams, request_id, created))
    finals = await wait_for_finals(request, streams, ctx.metrics)
    if finals is None:
        return Response(status_code=499)
    final = finals[0]
    choices = [ChatChoice(index=o.index, message=ChatMessageOut(content=o.text),
                          logprobs=_logprobs(req, model, o, 0), finish_reason=o.finish_reason,
                          stop_reason=o.stop_reason)
               for o in sorted(final.outputs, key=lambda o: o.index)]
    return ChatCompletionResponse(id=request_id, created=created, model=model.name, choices=choices,
                                  usage=_usage(final))


def _usage(final: RequestOutput) -> Usage:
    prompt, completion = len(final.prompt_token_ids), sum(len(o.token_ids) for o in final.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _logprobs(req: ChatCompletionRequest, model: ServedModel, out: CompletionOutput,
              token_start: int) -> ChatLogprobs | None:
    if not req.logprobs or out.logprobs is None:
        return None
    return ChatLogprobs(content=chat_logprobs(out.token_ids[token_start:], out.logprobs[token_start:],
                                              req.top_logprobs or 0, model.tokenizer))


async def _stream(req: ChatCompletionRequest, ctx: ServerContext, model: ServedModel,
                  streams: list[RequestStream], request_id: str, created: int) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse_event(ChatCompletionChunk(id=request_id, created=created, model=model.name, choices=choices,
                                             usage=usage))

    sent_text = [0] * req.n
    sent_tokens = [0] * req.n
    done: set[int] = set()
    final: RequestOutput | None = None
    try:
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        async with aclosing(merge(streams, ctx.metrics)) as outputs:
            async for _, out in outputs:
                for c in out.outputs:
                    if c.index in done or (len(c.token_ids) == sent_tokens[c.index] and not c.finished()):
                        continue
                    delta = DeltaMessage(content=c.text[sent_text[c.index]:])
                    choice = ChatChunkChoice(index=c.index, delta=delta,
                                             logprobs=_logprobs(req, model, c, sent_tokens[c.index]),
                                             finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    if c.finished():
                        done.add(c.index)
                    yield chunk([choice])
                final = out
        if req.stream_options and req.stream_options.include_usage and final is not None:
            yield chunk([], _usage(final))
    except Exception as exc:  # noqa: BLE001 - the stream already started: report the error in-band
        yield stream_error_event(exc)
    finally:
        close_all(streams)
    yield DONE
