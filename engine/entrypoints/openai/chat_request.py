"""Build the ChatCompletionRequest that another API's route (Responses, Anthropic Messages) runs on the chat path.

The other route has already read its own body; what it derives (messages, tools, sampling fields) is
validated here by the chat request model, and a value that fails is a 400 naming the field as the client
sent it (`where` maps the chat field name back to the route's own), never a 500 or a chat field's name.
"""
from __future__ import annotations

from typing import Any, Callable

from pydantic import ValidationError

from engine.entrypoints.openai.errors import OpenAIError, bad_request
from engine.entrypoints.openai.protocol import ChatCompletionRequest


def chat_request(payload: dict[str, Any], where: Callable[[str], str] = lambda field: field) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in payload.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(p) for p in error.get("loc", ()) if not str(p).startswith(("function-", "list[")))
        field = where(path) if path else None
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        raise bad_request(f"{field}: {message}" if field else message, field) from None


def reraise_as(exc: OpenAIError, where: Callable[[str | None], str | None]) -> OpenAIError:
    """The same refusal with its `param` (and the field's name in the message) named as the client's route
    names it."""
    param = where(exc.param)
    message = exc.message.replace(exc.param, param) if exc.param and param else exc.message
    return OpenAIError(exc.status, message, param, exc.code)
