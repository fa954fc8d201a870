"""POST /v1/chat/completions: messages → chat template → one engine request with n choices, whole or as SSE.

Streams follow OpenAI's chunk order: a role chunk per choice, deltas (content, reasoning_content,
tool_calls), a finish chunk per choice, then (with stream_options.include_usage) a usage chunk with no
choices, then `[DONE]`. tool_choice `required` / named and response_format are enforced by a grammar
(forced calls work on any template: without a tool section the tools go in a system preamble,
tool_preamble.py); under `auto` the model's tool parser reads calls out of the text (chat_outputs).
"""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request, Response

from engine.entrypoints.async_engine import RequestStream
from engine.core.outputs import CompletionOutput, RequestOutput
from engine.reasoning import get_reasoning_parser
from engine.sample.sampling_params import MAX_LOGPROBS
from engine.entrypoints.openai.chat_outputs import ChatOutputPlan, ChoiceView, api_stop_reason, finish_reason
from engine.entrypoints.openai.beam import beam_search_params
from engine.entrypoints.openai.context import ServerContext, get_context
from engine.entrypoints.openai.errors import bad_request, engine_error, stream_error_event
from engine.entrypoints.openai.generation import close_all, merge, start_requests, wait_for_finals
from engine.entrypoints.openai.logprobs import chat_logprobs, token_names, vllm_prompt_logprobs
from engine.entrypoints.openai.prompts import (Prompt, chat_prompt, message_chars, message_text, resolve_max_tokens,
                                   template_kwargs, truncate_prompt)
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.refusals import refuse_unsupported
from engine.entrypoints.openai.responses import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                     ChatLogprobs, DeltaMessage, Usage)
from engine.entrypoints.openai.sampling import sampling_params
from engine.entrypoints.openai.served_model import ServedModel
from engine.entrypoints.openai.sse import DONE, SSE_RESPONSE_DOC, sse_event, sse_response
from engine.entrypoints.openai.structured import compile_or_400, structured_outputs_for, tool_call_schema
from engine.entrypoints.openai.tokenize_pool import off_loop
from engine.entrypoints.openai.tool_preamble import with_tool_preamble
from engine.entrypoints.openai.usage import usage_of
from engine.tool_parsers import get_tool_parser

router = APIRouter()


def _check_supported(req: ChatCompletionRequest) -> int | None:
    """Refuse what is not built; return the engine's logprobs count (None: off)."""
    refuse_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}", "top_logprobs")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of other than n is not supported (got best_of={req.best_of}, n={req.n})", "best_of")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs works without stream", "prompt_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def output_plan(req: ChatCompletionRequest, model: ServedModel) -> tuple[ChatOutputPlan, dict | None]:
    """How choices are read, and the JSON schema a forced tool call must match (None: not forced)."""
    choice = req.tool_choice if req.tools else None
    if choice is None and req.tools and model.tool_parser is not None:
        choice = "auto"  # OpenAI's default when tools are given (without a parser, calls stay text)
    if req.tool_choice not in (None, "none", "auto") and not req.tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    plan = ChatOutputPlan(reasoning=get_reasoning_parser(model.reasoning_parser),
                          include_reasoning=req.include_reasoning,
                          max_calls=1 if req.parallel_tool_calls is False else None)
    if choice in (None, "none"):
        return plan, None
    if choice == "auto":
        if not model.supports_tools:
            raise bad_request(f"tool_choice 'auto' needs a chat template that shows tools, and {model.name!r}'s has "
                              "no tool section; force a call with tool_choice 'required' or a named function (the "
                              "tools are then described in a system message)", "tool_choice")
        if model.tool_parser is None:
            raise bad_request(f"tool_choice 'auto' needs a tool-call parser: {model.name!r}'s chat template shows "
                              "no known tool-call format; start the server with --tool-call-parser", "tool_choice")
        plan.tool_parser = get_tool_parser(model.tool_parser)
        plan.tool_parser.bind_tools(req.tools)
        return plan, None
    if choice == "required":
        plan.forced_required, plan.reasoning = True, None
    else:
        names = [t.function.name for t in req.tools]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in tools ({names})",
                              "tool_choice")
        plan.forced_name, plan.reasoning = choice.function.name, None
    return plan, tool_call_schema(req.tools, choice, req.parallel_tool_calls is not False)


@dataclass
class ChatRun:
    """One chat request admitted to the engine: how its choices are read and the engine streams."""

    model: ServedModel
    plan: ChatOutputPlan
    streams: list[RequestStream]
    request_id: str
    created: int
    prompt_tokens: int


async def render_prompt(req: ChatCompletionRequest, model: ServedModel, forced: bool) -> Prompt:
    """The request's prompt ids (`forced`: tool_choice makes the grammar hold a call, see output_plan)."""
    tools, messages = None if req.tool_choice == "none" else req.tools, req.messages
    if tools and forced and not model.supports_tools:  # the grammar holds the call's shape
        tools, messages = None, with_tool_preamble(messages, req.tools, req.tool_choice)
    prompt = await off_loop(message_chars(messages), chat_prompt, model, messages, tools,
                            req.add_generation_prompt, req.continue_final_message,
                            template_kwargs(model, req.chat_template_kwargs, req.reasoning_effort),
                            req.add_special_tokens)
    return truncate_prompt(prompt, req.truncate_prompt_tokens, model.max_model_len, req.truncation_side)


async def start_chat(req: ChatCompletionRequest, ctx: ServerContext, id_prefix: str = "chatcmpl-") -> ChatRun:
    """Check, render and admit a chat request; every chat-shaped route (chat, responses, messages) runs this."""
    model = ctx.model_for(req.model)
    logprobs = _check_supported(req)
    plan, forced_schema = output_plan(req, model)
    structured, source = structured_outputs_for(req, forced_schema)
    await compile_or_400(model, structured, source)
    prompt = await render_prompt(req, model, forced_schema is not None)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(requested, len(prompt.token_ids), model.max_model_len, param)
    params = sampling_params(req, max_tokens, logprobs, model.vocab_size, structured, req.prompt_logprobs)
    if plan.needs_special_tokens:
        params.skip_special_tokens = False
    beam = beam_search_params(req, params.max_tokens)
    request_id = f"{id_prefix}{req.request_id or uuid.uuid4().hex}"
    try:
        streams = await start_requests(ctx.async_engine, request_id, [prompt.token_ids], [params], req.cache_salt,
                                       [beam], req.priority, mms=[prompt.mm])
    except Exception as exc:  # noqa: BLE001
        raise engine_error(exc) from None
    return ChatRun(model, plan, streams, request_id, int(time.time()), len(prompt.token_ids))


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=SSE_RESPONSE_DOC)
async def create_chat_completion(req: ChatCompletionRequest, request: Request,
                                 ctx: ServerContext = Depends(get_context)) -> Response | ChatCompletionResponse:
    run = await start_chat(req, ctx)
    model, plan, streams, request_id, created = run.model, run.plan, run.streams, run.request_id, run.created
    if req.stream:
        return sse_response(_stream(req, ctx, model, plan, streams, request_id, created))
    finals = await wait_for_finals(request, streams, ctx.metrics)
    if finals is None:
        return Response(status_code=499)
    final = finals[0]
    choices, echo = [], _echo(req)
    for o in sorted(final.outputs, key=lambda o: o.index):
        view = ChoiceView(plan)
        message = view.message(o.text)
        if echo:
            message.content = echo + (message.content or "")
        choices.append(ChatChoice(index=o.index, message=message, logprobs=_logprobs(req, model, o, 0),
                                  finish_reason=finish_reason(o.finish_reason, view),
                                  stop_reason=api_stop_reason(o.stop_reason, req.stop_token_ids),
                                  token_ids=o.token_ids if req.return_token_ids else None))
    prompt_logprobs = None if final.prompt_logprobs is None else \
        vllm_prompt_logprobs(final.prompt_logprobs, token_names(req, model.tokenizer))
    return ChatCompletionResponse(id=request_id, created=created, model=model.name, choices=choices,
                                  usage=usage_of([final]), prompt_logprobs=prompt_logprobs,
                                  prompt_token_ids=final.prompt_token_ids if req.return_token_ids else None)


def _echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the reply starts with the last message's text when that message is the assistant's."""
    last = req.messages[-1]
    return message_text(last, len(req.messages) - 1) if req.echo and last.role == "assistant" else ""


def _logprobs(req: ChatCompletionRequest, model: ServedModel, out: CompletionOutput,
              token_start: int) -> ChatLogprobs | None:
    if not req.logprobs or out.logprobs is None:
        return None
    return ChatLogprobs(content=chat_logprobs(out.token_ids[token_start:], out.logprobs[token_start:],
                                              req.top_logprobs or 0, token_names(req, model.tokenizer)))


async def _stream(req: ChatCompletionRequest, ctx: ServerContext, model: ServedModel, plan: ChatOutputPlan,
                  streams: list[RequestStream], request_id: str, created: int) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse_event(ChatCompletionChunk(id=request_id, created=created, model=model.name, choices=choices,
                                             usage=usage))

    views = [ChoiceView(plan) for _ in range(req.n)]
    so = req.stream_options  # vLLM: usage so far in every chunk when both are set
    continuous = bool(so and so.include_usage and so.continuous_usage_stats)
    sent_tokens = [0] * req.n
    done: set[int] = set()
    final: RequestOutput | None = None
    try:
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=_echo(req)))
                     for i in range(req.n)])
        async with aclosing(merge(streams, ctx.metrics)) as outputs:
            async for _, out in outputs:
                for c in out.outputs:
                    if c.index in done or (len(c.token_ids) == sent_tokens[c.index] and not c.finished()):
                        continue
                    view = views[c.index]
                    delta = view.update(c.text, c.finished())
                    logprobs = _logprobs(req, model, c, sent_tokens[c.index])
                    new_ids = c.token_ids[sent_tokens[c.index]:] if req.return_token_ids else None
                    sent_tokens[c.index] = len(c.token_ids)
                    if c.finished():
                        done.add(c.index)
                    elif delta is None and logprobs is None and not new_ids:
                        continue
                    yield chunk([ChatChunkChoice(index=c.index, delta=delta or DeltaMessage(), logprobs=logprobs,
                                                 finish_reason=finish_reason(c.finish_reason, view),
                                                 stop_reason=api_stop_reason(c.stop_reason, req.stop_token_ids),
                                                 token_ids=new_ids)],
                                usage_of([out]) if continuous else None)
                final = out
        if req.stream_options and req.stream_options.include_usage and final is not None:
            yield chunk([], usage_of([final]))
    except Exception as exc:  # noqa: BLE001 - the stream already started: report the error in-band
        yield stream_error_event(exc)
    finally:
        close_all(streams)
    yield DONE
