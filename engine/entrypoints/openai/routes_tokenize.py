"""POST /tokenize and POST /detokenize in vLLM's shapes: text or chat messages → ids, and ids → text.

Both run their tokenizer work in the tokenizer pool (tokenize_pool.py), never on the event loop; text is
capped like a prompt (prompts.check_prompt_chars) before it is tokenized.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends

from engine.entrypoints.openai.context import ServerContext, get_context
from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.prompts import chat_token_ids, check_token_ids, encode, message_chars
from engine.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from engine.entrypoints.openai.responses import DetokenizeResponse, TokenizeResponse
from engine.entrypoints.openai.served_model import ServedModel
from engine.entrypoints.openai.tokenize_pool import off_loop

router = APIRouter()


def _tokenize(model: ServedModel, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of 'prompt' or 'messages'", "prompt")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = encode(model, req.prompt, add_special)
    else:
        ids = chat_token_ids(model, req.messages, req.tools, req.add_generation_prompt, req.continue_final_message,
                             bool(req.add_special_tokens), req.chat_template_kwargs).token_ids
    return ids, (model.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None)


def _detokenize(model: ServedModel, tokens: list[int]) -> str:
    check_token_ids(tokens, model.vocab_size, "tokens")
    return model.tokenizer.decode(tokens)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(req: TokenizeRequest, ctx: ServerContext = Depends(get_context)) -> TokenizeResponse:
    model = ctx.model_for(req.model)
    ids, strs = await off_loop(len(req.prompt or "") + message_chars(req.messages), _tokenize, model, req)
    return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(req: DetokenizeRequest, ctx: ServerContext = Depends(get_context)) -> DetokenizeResponse:
    model = ctx.model_for(req.model)
    return DetokenizeResponse(prompt=await off_loop(len(req.tokens), _detokenize, model, req.tokens))
