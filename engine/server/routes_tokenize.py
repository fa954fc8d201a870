"""POST /tokenize and POST /detokenize in vLLM's shapes: text or chat messages → ids, and ids → text."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from engine.server.context import ServerContext, get_context
from engine.server.errors import bad_request
from engine.server.prompts import check_token_ids, encode, render_chat
from engine.server.protocol import DetokenizeRequest, TokenizeRequest
from engine.server.responses import DetokenizeResponse, TokenizeResponse
from engine.server.served_model import ServedModel

router = APIRouter()


def _tokenize(model: ServedModel, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of 'prompt' or 'messages'", "prompt")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        return encode(model, req.prompt, add_special)
    text = render_chat(model, req.messages, req.tools, req.add_generation_prompt, req.continue_final_message,
                       req.chat_template_kwargs)
    return encode(model, text, bool(req.add_special_tokens))


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(req: TokenizeRequest, ctx: ServerContext = Depends(get_context)) -> TokenizeResponse:
    model = ctx.model_for(req.model)
    ids = await asyncio.to_thread(_tokenize, model, req)
    strs = model.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(req: DetokenizeRequest, ctx: ServerContext = Depends(get_context)) -> DetokenizeResponse:
    model = ctx.model_for(req.model)
    check_token_ids(req.tokens, model.vocab_size, "tokens")
    return DetokenizeResponse(prompt=model.tokenizer.decode(req.tokens))
