"""Unknown request fields: accepted and ignored (as vLLM does), logged once per name, and named back to the client
in the `x-pagedesk-ignored-fields` response header; `--strict-request-fields` refuses them with a 400 instead.

Agent clients send fields their vendors added last month (Codex's `client_metadata`, a chat message's extra key);
refusing them breaks the first request of a client nobody can reconfigure. Fields we know and cannot honour are a
different matter: they stay a 400 (refusals.py, docs/server.md), since ignoring them would change the result.
`RequestFieldsMiddleware` gives each request a `FieldReport` (a context variable, so the body's validators reach
it without a handle); the top-level request models call `report_unknown` once validated, which walks the model
tree, records every extra key by its dotted path and removes it, so no ignored value reaches a template or an echo.
Hand-read parts of a body (Responses tools) call `ignore` directly.
"""
from __future__ import annotations

import contextvars
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from engine.entrypoints.openai.errors import OpenAIError, is_anthropic_path

log = logging.getLogger("pagedesk.server")

HEADER = "x-pagedesk-ignored-fields"
MAX_HEADER_FIELDS = 32  # a body of a thousand unknown keys must not make a header of megabytes
MAX_NAME_CHARS = 100
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_$*.-]+")
MAX_LOGGED_NAMES = 1000  # names are the client's: a fuzzer's endless new ones must not grow memory (or the log)


@dataclass
class FieldReport:
    """One request's ignored fields (dotted paths, in the order met) and the server's policy."""

    strict: bool = False
    path: str = ""
    ignored: list[str] = field(default_factory=list)


_current: contextvars.ContextVar[FieldReport | None] = contextvars.ContextVar("pagedesk_field_report", default=None)
_logged: set[tuple[str, str | None]] = set()
_logged_lock = threading.Lock()


def _api_name(path: str) -> str:
    return "the Anthropic Messages API" if is_anthropic_path(path) else "the OpenAI or vLLM API"


def ignore(path: str, why: str | None = None) -> None:
    """Record that the request's field `path` is ignored (a 400 naming it under --strict-request-fields)."""
    report = _current.get()
    if report is None:  # outside a request (offline use of the models): nothing to report to
        return
    if report.strict:
        message = f"{path}: {why}" if why else f"unknown field {path!r}: it is not part of {_api_name(report.path)}"
        raise OpenAIError(400, f"{message} (the server runs with --strict-request-fields)", path)
    if path not in report.ignored:
        report.ignored.append(path)
    name = re.sub(r"\.\d+(?=\.|$)", ".*", path)  # messages.3.mood and messages.7.mood are one name
    with _logged_lock:
        first = (name, why) not in _logged and len(_logged) < MAX_LOGGED_NAMES
        if first:
            _logged.add((name, why))
    if first:
        log.warning("ignoring request field %r on %s%s (logged once per field name)", name, report.path or "?",
                    f": {why}" if why else "")


def report_unknown(model: BaseModel, prefix: str = "") -> None:
    """Record and drop every unknown key of `model` and of the request models nested in it."""
    extra = model.__pydantic_extra__
    if extra and getattr(model, "report_extra", True):
        for key in list(extra):
            ignore(f"{prefix}{key}")
            del extra[key]
    for name in type(model).model_fields:
        _walk(getattr(model, name, None), f"{prefix}{name}.")


def _walk(value: Any, prefix: str) -> None:
    if isinstance(value, BaseModel):
        report_unknown(value, prefix)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, BaseModel):
                report_unknown(item, f"{prefix}{i}.")


def header_value(ignored: list[str]) -> str:
    """The header's text: a field name is the client's and may be empty or hold a newline or a character no header
    can carry, so any name other than plain identifiers and dots is written as a JSON string (ASCII escapes),
    each cut at MAX_NAME_CHARS, at most MAX_HEADER_FIELDS names."""
    def safe(path: str) -> str:
        path = path if len(path) <= MAX_NAME_CHARS else path[:MAX_NAME_CHARS - 3] + "..."
        return path if _PLAIN_NAME.fullmatch(path) else json.dumps(path)

    shown = [safe(p) for p in ignored[:MAX_HEADER_FIELDS]]
    more = len(ignored) - len(shown)
    return ", ".join(shown) + (f", ... ({more} more)" if more else "")


class RequestFieldsMiddleware:
    """Gives each HTTP request a FieldReport and, when it ignored something, adds the header to the response."""

    def __init__(self, app: Any, strict: bool = False) -> None:
        self.app, self.strict = app, strict

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        report = FieldReport(self.strict, scope.get("path", ""))
        token = _current.set(report)

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start" and report.ignored:
                headers = list(message.get("headers", []))
                headers.append((HEADER.encode(), header_value(report.ignored).encode("ascii")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        finally:
            _current.reset(token)
