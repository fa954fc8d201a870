"""POST /v1/completions: prompts (text, ids, or a batch of either) → choices, whole or streamed as SSE.

Choice `i * n + j` is sample j of prompt i, as in OpenAI's API. `echo` prepends the prompt; prompt
logprobs are not computed, so echo with logprobs, and echo with max_tokens 0 (prompt scoring), are
refused with a 400 that says so.
"""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request, Response

from engine.async_engine import RequestStream
from engine.outputs import CompletionOutput, RequestOutput
from engine.server.context import ServerContext, get_context
from engine.server.errors import bad_request, engine_error, stream_error_event
from engine.server.generation import close_all, merge, start_requests, wait_for_finals
from engine.server.logprobs import completion_logprobs
from engine.server.prompts import Prompt, completion_prompts, prompt_chars, resolve_max_tokens
from engine.server.protocol import CompletionRequest
from engine.server.responses import CompletionChoice, CompletionResponse, Usage
from engine.server.sampling import sampling_params
from engine.server.served_model import ServedModel
from engine.server.sse import DONE, SSE_RESPONSE_DOC, sse_event, sse_response
from engine.server.tokenize_pool import off_loop

MAX_PROMPTS = 64

router = APIRouter()


def _check_supported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of other than n is not supported (got best_of={req.best_of}, n={req.n})",
                          "best_of")
    if req.echo and req.max_tokens is not None and req.max_tokens <= 0:
        raise bad_request("echo with max_tokens=0 (prompt scoring) is not supported: this engine does not "
                          "compute prompt logprobs; ask for at least 1 token", "max_tokens")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported: this engine does not compute prompt logprobs",
                          "logprobs")


@router.post("/v1/completions", response_model=CompletionResponse, responses=SSE_RESPONSE_DOC)
async def create_completion(req: CompletionRequest, request: Request,
                            ctx: ServerContext = Depends(get_context)) -> Response | CompletionResponse:
    model = ctx.model_for(req.model)
    _check_supported(req)
    prompts = await off_loop(prompt_chars(req.prompt), completion_prompts, model, req.prompt, req.add_special_tokens)
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    params = [sampling_params(req, resolve_max_tokens(req.max_tokens, len(p.token_ids), model.max_model_len),
                              req.logprobs, model.vocab_size) for p in prompts]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    try:
        streams = await start_requests(ctx.async_engine, request_id, [p.token_ids for p in prompts], params)
    except Exception as exc:  # noqa: BLE001
        raise engine_error(exc) from None
    created = int(time.time())
    if req.stream:
        return sse_response(_stream(req, ctx, model, prompts, streams, request_id, created))
    finals = await wait_for_finals(request, streams, ctx.metrics)
    if finals is None:
        return Response(status_code=499)
    return _response(req, model, prompts, finals, request_id, created)


def _prompt_text(model: ServedModel, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else model.tokenizer.decode(prompt.token_ids)


def _usage(finals: list[RequestOutput]) -> Usage:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _choice(req: CompletionRequest, model: ServedModel, index: int, out: CompletionOutput, prefix: str,
            token_start: int, text_start: int) -> CompletionChoice:
    logprobs = None
    if req.logprobs is not None and out.logprobs is not None:
        logprobs = completion_logprobs(out.token_ids[token_start:], out.logprobs[token_start:], req.logprobs,
                                       model.tokenizer, len(prefix) + text_start)
    return CompletionChoice(index=index, text=prefix + out.text[text_start:], logprobs=logprobs,
                            finish_reason=out.finish_reason, stop_reason=out.stop_reason)


def _response(req: CompletionRequest, model: ServedModel, prompts: list[Prompt], finals: list[RequestOutput],
              request_id: str, created: int) -> CompletionResponse:
    choices = []
    for i, final in enumerate(finals):
        prefix = _prompt_text(model, prompts[i]) if req.echo else ""
        for out in sorted(final.outputs, key=lambda o: o.index):
            choices.append(_choice(req, model, i * req.n + out.index, out, prefix, 0, 0))
    return CompletionResponse(id=request_id, created=created, model=model.name, choices=choices,
                              usage=_usage(finals))


async def _stream(req: CompletionRequest, ctx: ServerContext, model: ServedModel, prompts: list[Prompt],
                  streams: list[RequestStream], request_id: str, created: int) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    finals: list[RequestOutput] = []
    try:
        async with aclosing(merge(streams, ctx.metrics)) as outputs:
            async for i, out in outputs:
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in done:
                        continue
                    first = index not in sent_text
                    text_start, token_start = sent_text.get(index, 0), sent_tokens.get(index, 0)
                    if not first and len(c.token_ids) == token_start and not c.finished():
                        continue
                    prefix = _prompt_text(model, prompts[i]) if req.echo and first else ""
                    choice = _choice(req, model, index, c, prefix, token_start, text_start)
                    sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                    if c.finished():
                        done.add(index)
                    yield sse_event(CompletionResponse(id=request_id, created=created, model=model.name,
                                                       choices=[choice]).model_dump(exclude={"usage"}))
                if out.finished:
                    finals.append(out)
        if req.stream_options and req.stream_options.include_usage:
            yield sse_event(CompletionResponse(id=request_id, created=created, model=model.name, choices=[],
                                               usage=_usage(finals)))
    except Exception as exc:  # noqa: BLE001 - the stream already started: report the error in-band
        yield stream_error_event(exc)
    finally:
        close_all(streams)
    yield DONE
