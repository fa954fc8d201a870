"""POST /v1/completions: prompts (text, ids, or a batch of either) → choices, whole or streamed as SSE.

Choice `i * n + j` is sample j of prompt i, as in OpenAI's API. `echo` prepends the prompt; with
`logprobs: k` the prompt's tokens come first in the logprobs lists (the first token's logprob null, as
in OpenAI's legacy API), and `max_tokens: 0` with echo scores the prompt without generating (lm-eval's
loglikelihood requests). vLLM's `prompt_logprobs: k` returns each choice's prompt logprobs as vLLM does.
"""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request, Response

from engine.entrypoints.async_engine import RequestStream
from engine.core.outputs import CompletionOutput, RequestOutput
from engine.entrypoints.openai.beam import beam_search_params
from engine.entrypoints.openai.context import ServerContext, get_context
from engine.entrypoints.openai.errors import bad_request, engine_error, stream_error_event
from engine.entrypoints.openai.generation import close_all, merge, start_requests, wait_for_finals
from engine.entrypoints.openai.logprobs import completion_logprobs, token_names, vllm_prompt_logprobs
from engine.entrypoints.openai.prompts import Prompt, completion_prompts, prompt_chars, resolve_max_tokens, truncate_prompt
from engine.entrypoints.openai.protocol import CompletionRequest
from engine.entrypoints.openai.chat_outputs import api_stop_reason
from engine.entrypoints.openai.refusals import refuse_unsupported
from engine.entrypoints.openai.responses import CompletionChoice, CompletionLogprobs, CompletionResponse
from engine.entrypoints.openai.sampling import sampling_params
from engine.entrypoints.openai.served_model import ServedModel
from engine.entrypoints.openai.sse import DONE, SSE_RESPONSE_DOC, sse_event, sse_response
from engine.entrypoints.openai.structured import compile_or_400, structured_outputs_for
from engine.entrypoints.openai.tokenize_pool import off_loop
from engine.entrypoints.openai.usage import usage_of

MAX_PROMPTS = 64

router = APIRouter()


def _check_supported(req: CompletionRequest) -> None:
    refuse_unsupported(req)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of other than n is not supported (got best_of={req.best_of}, n={req.n})",
                          "best_of")
    if _scoring_only(req) and (req.stream or req.n != 1):
        raise bad_request("max_tokens=0 (prompt scoring) works with n=1 and without stream", "max_tokens")


def _scoring_only(req: CompletionRequest) -> bool:
    """echo + max_tokens 0: the engine runs one token (it must sample to finish) and the reply drops it."""
    return req.echo and req.max_tokens == 0


def _engine_prompt_logprobs(req: CompletionRequest) -> int | None:
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    return max(wanted) if wanted else None


@router.post("/v1/completions", response_model=CompletionResponse, responses=SSE_RESPONSE_DOC)
async def create_completion(req: CompletionRequest, request: Request,
                            ctx: ServerContext = Depends(get_context)) -> Response | CompletionResponse:
    model = ctx.model_for(req.model)
    _check_supported(req)
    structured, source = structured_outputs_for(req)
    await compile_or_400(model, structured, source)
    prompts = await off_loop(prompt_chars(req.prompt), completion_prompts, model, req.prompt, req.add_special_tokens)
    prompts = [truncate_prompt(p, req.truncate_prompt_tokens, model.max_model_len, req.truncation_side)
               for p in prompts]
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    max_tokens = 1 if _scoring_only(req) else req.max_tokens
    params = [sampling_params(req, resolve_max_tokens(max_tokens, len(p.token_ids), model.max_model_len),
                              req.logprobs, model.vocab_size, structured, _engine_prompt_logprobs(req))
              for p in prompts]
    beams = [beam_search_params(req, p.max_tokens) for p in params]
    request_id = f"cmpl-{req.request_id or uuid.uuid4().hex}"
    try:
        streams = await start_requests(ctx.async_engine, request_id, [p.token_ids for p in prompts], params,
                                       req.cache_salt, beams, req.priority)
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


def _choice(req: CompletionRequest, model: ServedModel, index: int, out: CompletionOutput, final: RequestOutput,
            prefix: str, token_start: int, text_start: int) -> CompletionChoice:
    """A choice from `token_start` / `text_start` on; `prefix` (the echoed prompt) only in the first one."""
    first = token_start == 0 and text_start == 0
    if _scoring_only(req):
        token_start, text_start = len(out.token_ids), len(out.text)
    logprobs = None
    if req.logprobs is not None:
        logprobs = CompletionLogprobs()
        if req.echo and first and final.prompt_logprobs is not None:
            completion_logprobs(final.prompt_token_ids, final.prompt_logprobs, req.logprobs,
                                token_names(req, model.tokenizer), 0, logprobs)
        if out.logprobs is not None:
            completion_logprobs(out.token_ids[token_start:], out.logprobs[token_start:], req.logprobs,
                                token_names(req, model.tokenizer), len(prefix) + text_start, logprobs)
    prompt_logprobs = None
    if req.prompt_logprobs is not None and first and final.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(final.prompt_logprobs, token_names(req, model.tokenizer))
    ids = req.return_token_ids or None
    return CompletionChoice(index=index, text=prefix + out.text[text_start:], logprobs=logprobs,
                            finish_reason="length" if _scoring_only(req) else out.finish_reason,
                            stop_reason=None if _scoring_only(req) else api_stop_reason(out.stop_reason,
                                                                                        req.stop_token_ids),
                            prompt_logprobs=prompt_logprobs,
                            prompt_token_ids=final.prompt_token_ids if ids and first else None,
                            token_ids=out.token_ids[token_start:] if ids else None)


def _response(req: CompletionRequest, model: ServedModel, prompts: list[Prompt], finals: list[RequestOutput],
              request_id: str, created: int) -> CompletionResponse:
    choices = []
    for i, final in enumerate(finals):
        prefix = _prompt_text(model, prompts[i]) if req.echo else ""
        for out in sorted(final.outputs, key=lambda o: o.index):
            choices.append(_choice(req, model, i * req.n + out.index, out, final, prefix, 0, 0))
    return CompletionResponse(id=request_id, created=created, model=model.name, choices=choices,
                              usage=usage_of(finals, count_completion=not _scoring_only(req)))


async def _stream(req: CompletionRequest, ctx: ServerContext, model: ServedModel, prompts: list[Prompt],
                  streams: list[RequestStream], request_id: str, created: int) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    finals: list[RequestOutput] = []
    latest: dict[int, RequestOutput] = {}  # per prompt, for continuous_usage_stats
    so = req.stream_options  # vLLM: usage so far in every chunk when both are set
    continuous = bool(so and so.include_usage and so.continuous_usage_stats)
    try:
        async with aclosing(merge(streams, ctx.metrics)) as outputs:
            async for i, out in outputs:
                latest[i] = out
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in done:
                        continue
                    first = index not in sent_text
                    text_start, token_start = sent_text.get(index, 0), sent_tokens.get(index, 0)
                    if not first and len(c.token_ids) == token_start and not c.finished():
                        continue
                    prefix = _prompt_text(model, prompts[i]) if req.echo and first else ""
                    choice = _choice(req, model, index, c, out, prefix, token_start, text_start)
                    sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                    if c.finished():
                        done.add(index)
                    usage = usage_of(list(latest.values())) if continuous else None
                    yield sse_event(CompletionResponse(id=request_id, created=created, model=model.name,
                                                       choices=[choice], usage=usage),
                                    exclude=None if continuous else {"usage"})
                if out.finished:
                    finals.append(out)
        if req.stream_options and req.stream_options.include_usage:
            yield sse_event(CompletionResponse(id=request_id, created=created, model=model.name, choices=[],
                                               usage=usage_of(finals)))
    except Exception as exc:  # noqa: BLE001 - the stream already started: report the error in-band
        yield stream_error_event(exc)
    finally:
        close_all(streams)
    yield DONE
