"""POST /v1/embeddings: one pooled vector per input (OpenAI's shape), from an engine serving embeddings.

Each input is its own engine request (`<id>-<i>`) with PoolingParams: prompt-only, never sampled, prefix
caching applied by the engine as for any prompt. A generation engine (not started with `--task embed`) answers
400 saying so, before any tokenizing. `encoding_format: base64` returns each vector as little-endian float32
bytes in base64, which the openai SDK requests by default and decodes.
"""
from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from fastapi import APIRouter, Depends, Request, Response

from engine.core.outputs import PoolingRequestOutput
from engine.config.pooler import task_mismatch
from engine.sample.pooling import PoolingParams
from engine.entrypoints.openai.context import ServerContext, get_context
from engine.entrypoints.openai.errors import bad_request, engine_error
from engine.entrypoints.openai.generation import close_all, start_requests, unless_disconnected
from engine.entrypoints.openai.prompts import Prompt, check_token_ids, encode, prompt_chars, truncate_prompt
from engine.entrypoints.openai.protocol_embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from engine.entrypoints.openai.served_model import ServedModel
from engine.entrypoints.openai.tokenize_pool import off_loop

router = APIRouter()


def embedding_prompts(model: ServedModel, inputs: str | list, add_special_tokens: bool) -> list[Prompt]:
    """OpenAI's four `input` forms as one Prompt per entry (the protocol already refused empty ones)."""
    if isinstance(inputs, str):
        entries: list = [inputs]
    elif all(isinstance(t, int) for t in inputs):
        entries = [list(inputs)]
    else:
        entries = list(inputs)
    prompts = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            ids = encode(model, entry, add_special_tokens)
            if not ids:
                raise bad_request(f"input[{i}] encodes to zero tokens", "input")
            prompts.append(Prompt(entry, ids))
        else:
            check_token_ids(entry, model.vocab_size, "input")
            prompts.append(Prompt(None, list(entry)))
    return prompts


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def _finals(streams) -> list[PoolingRequestOutput]:
    finals = []
    for stream in streams:
        final = None
        async for out in stream:
            final = out
        finals.append(final)
    return finals


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create_embedding(req: EmbeddingRequest, request: Request,
                           ctx: ServerContext = Depends(get_context)) -> Response | EmbeddingResponse:
    model = ctx.model_for(req.model)
    mismatch = task_mismatch(model.pooler, embedding=True)
    if mismatch:
        raise bad_request(f"model `{model.name}`: {mismatch}", "model")
    prompts = await off_loop(prompt_chars(req.input), embedding_prompts, model, req.input, req.add_special_tokens)
    prompts = [truncate_prompt(p, req.truncate_prompt_tokens, model.max_model_len) for p in prompts]
    request_id = f"embd-{req.request_id or uuid.uuid4().hex}"
    pooling = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    try:
        streams = await start_requests(ctx.async_engine, request_id, [p.token_ids for p in prompts],
                                       [None] * len(prompts), priority=req.priority, pooling=pooling)
    except Exception as exc:  # noqa: BLE001
        raise engine_error(exc) from None
    try:
        finished, finals = await unless_disconnected(request, _finals(streams))
    except Exception as exc:  # noqa: BLE001 - engine errors become OpenAI-shaped responses
        raise engine_error(exc) from None
    finally:
        close_all(streams)
    if not finished:
        return Response(status_code=499)
    num_tokens = sum(len(f.prompt_token_ids) for f in finals)
    data = [Embedding(index=i, embedding=encode_vector(f.outputs.embedding, req.encoding_format))
            for i, f in enumerate(finals)]
    return EmbeddingResponse(id=request_id, created=int(time.time()), model=model.name, data=data,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
