"""POST /v1/responses/compact: a long conversation condensed into a few items a client continues from.

Codex calls it when its provider is OpenAI's (a user who points `openai_base_url` at this server); with a
custom provider it compacts by itself through /v1/responses. The model reads the conversation (instructions,
`input`, or a stored response's conversation through `previous_response_id`) with a request to summarise it;
the reply is Open Responses' CompactResource: the user's own messages kept as they were, then one `compaction`
item whose `encrypted_content` is that summary in plain text (nothing here is encrypted: it never leaves the
machine). Sent back in a later `input`, the compaction item becomes a user message holding the summary
(responses_input.py), so the model continues from it.
"""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from engine.entrypoints.openai.chat_outputs import ChoiceView
from engine.entrypoints.openai.chat_request import chat_request, reraise_as
from engine.entrypoints.openai.context import ServerContext, get_context
from engine.entrypoints.openai.errors import OpenAIError, bad_request
from engine.entrypoints.openai.generation import wait_for_finals
from engine.entrypoints.openai.protocol import RequestBody, Text
from engine.entrypoints.openai.responses_input import input_messages, responses_field
from engine.entrypoints.openai.responses_output import new_id, usage_object
from engine.entrypoints.openai.routes_chat import start_chat

router = APIRouter()

COMPACTION_PROMPT = (
    "Write a summary of the conversation above for yourself, to continue the work from it alone: the goal, what "
    "was decided and done, the files, commands and facts that matter, and what remains to do. Reply with the "
    "summary only.")


class CompactRequest(RequestBody):
    model: Text | None = None
    input: Text | list[dict[str, Any]] | None = None
    instructions: Text | None = None
    previous_response_id: Text | None = None
    prompt_cache_key: Text | None = None  # a routing hint; the prefix cache is automatic


def _kept_user_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": m["content"]}]}
            for m in messages if m["role"] == "user" and isinstance(m.get("content"), str)]


@router.post("/v1/responses/compact", response_model=None)
async def compact_response(req: CompactRequest, request: Request,
                           ctx: ServerContext = Depends(get_context)) -> Response | dict:
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = ctx.responses.get(req.previous_response_id)
        if stored is None:
            raise bad_request(f"previous_response_id {req.previous_response_id!r} names no stored response",
                              "previous_response_id")
        history = stored.conversation
    conversation = history + (input_messages(req.input) if req.input else [])
    if not conversation:
        raise bad_request("input holds no message to compact", "input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat = chat_request({"model": req.model, "messages": system + conversation
                         + [{"role": "user", "content": COMPACTION_PROMPT}]}, responses_field)
    try:
        run = await start_chat(chat, ctx, id_prefix="resp_")
    except OpenAIError as exc:
        raise reraise_as(exc, responses_field) from None
    finals = await wait_for_finals(request, run.streams, ctx.metrics)
    if finals is None:
        return Response(status_code=499)
    final, out = finals[0], finals[0].outputs[0]
    summary = ChoiceView(run.plan).message(out.text).content or ""
    output = _kept_user_items(conversation) + [{"type": "compaction", "id": new_id("cmp"),
                                                "encrypted_content": summary}]
    usage = usage_object(len(final.prompt_token_ids), final.num_cached_tokens or 0, len(out.token_ids), 0)
    return {"id": run.request_id, "object": "response.compaction", "created_at": int(time.time()),
            "output": output, "usage": usage}
