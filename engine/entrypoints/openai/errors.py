"""OpenAI-shaped errors: one exception type for every refusal, and the handlers that render it.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` (under /v1/messages in
Anthropic's `{"type": "error", "error": {"type", "message"}}`) with a 4xx status for
anything a client sent (FastAPI's 422 validation errors become 400, `ValueError` from the engine becomes
400) and 503 while the engine is loading or dead. A 500 means a bug here, never bad input.
"""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine.entrypoints.exceptions import EngineDeadError, EngineNotReadyError, RequestFailedError, StreamIdleTimeout
from engine.entrypoints.openai.sse import sse_event

log = logging.getLogger("pagedesk.server")

_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
_FIELD_IN_MESSAGE = re.compile(r"^([a-z_]+) must ")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable_error"}


class OpenAIError(Exception):
    """A refusal with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


ANTHROPIC_PATH = "/v1/messages"  # this route and its count_tokens answer in Anthropic's error shape
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's shape: `{"type": "error", "error": {"type", "message"}}` (no param: the message names it)."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_response_for(path: str, status: int, message: str, param: str | None = None, code: str | None = None,
                       headers: dict | None = None) -> JSONResponse:
    """The error in the shape the route's API uses: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if is_anthropic_path(path):
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return error_response(status, message, param, code, headers)


def engine_error(exc: BaseException) -> OpenAIError:
    """Map what the engine raised to the error the client sees."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return value_error(exc)
    if isinstance(exc, EngineNotReadyError):
        return OpenAIError(503, str(exc), code="model_loading")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), code="engine_dead")
    if isinstance(exc, RequestFailedError):  # logged by the engine; the server goes on
        return OpenAIError(500, str(exc), code="request_failed")
    if isinstance(exc, StreamIdleTimeout):
        return OpenAIError(408, str(exc), code="stream_idle_timeout")
    log.error("internal error", exc_info=exc)
    return OpenAIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def value_error(exc: ValueError) -> OpenAIError:
    """A 400 for a ValueError; SamplingParams' messages start with the field name, which becomes `param`."""
    message = str(exc)
    match = _FIELD_IN_MESSAGE.match(message)
    return OpenAIError(400, message, match.group(1) if match else None)


def _clean_loc(loc: tuple) -> str | None:
    """Dotted field path without pydantic's union-branch tags ("str", "list[int]", "function-after[...]")."""
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if p.isdigit() or (p.isidentifier() and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


def _most_telling(errors: list[dict]) -> dict:
    """Of a union's branch errors, prefer a value error (e.g. a negative id) to 'wrong type' ones."""
    for error in errors:
        kind = error.get("type", "")
        if not (kind.endswith("_type") or kind.endswith("_parsing") or kind == "missing"):
            return error
    return errors[0]


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming the invalid field, and that field's dotted path as `param`."""
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    error = _most_telling(errors)
    if error.get("type") == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "invalid JSON")
        return f"request body is not valid JSON: {reason} at character {error['loc'][-1]}", None
    param = _clean_loc(error.get("loc", ()))
    if error.get("type") == "extra_forbidden":
        return f"unknown field {param!r}: it is not part of the OpenAI or vLLM API", param
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response_for(request.url.path, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        if is_anthropic_path(request.url.path):
            message = message.replace("the OpenAI or vLLM API", "the Anthropic Messages API")
        return error_response_for(request.url.path, 400, message, param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "could not parse the request body: send JSON encoded as UTF-8"
        route = f"{request.method} {request.url.path}"
        if exc.status_code == 404 and detail == "Not Found":  # the router's own: no such route
            return error_response(404, f"Invalid URL ({route}): this server has no such route; the routes are "
                                  "listed at /docs", code="unknown_url")
        if exc.status_code == 405 and detail == "Method Not Allowed":
            return error_response_for(request.url.path, 405, f"Method not allowed ({route}): the route exists for "
                                      "other methods", headers=getattr(exc, "headers", None))
        return error_response_for(request.url.path, exc.status_code, detail, headers=getattr(exc, "headers", None))

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        err = value_error(exc)
        return error_response_for(request.url.path, 400, err.message, err.param)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        err = engine_error(exc)
        return error_response_for(request.url.path, err.status, err.message, err.param, err.code)


def stream_error_event(exc: BaseException) -> str:
    """An error after a stream started goes in-band: one SSE event in OpenAI's error shape."""
    err = engine_error(exc)
    return sse_event(error_body(err.status, err.message, err.param, err.code))
