"""create_app: the FastAPI application of one server (routes, auth, error shape, body limit, metrics).

The app does not own the engine: the caller starts the AsyncEngine (model loading runs in its
thread while the server already answers /health with 503) and shuts it down. All per-server state
lives on `app.state.ctx`, so tests can run several apps in one process. The Host check (hosts.py) reads
the bind address and `--allowed-hosts` from the engine's config; CORS (cors.py) is on only with
`--allowed-origins`. Unknown request fields are ignored and named in a response header, or refused under
`--strict-request-fields` (ignored_fields.py).
"""
from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI

from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.openai import (routes_chat, routes_compact, routes_completions, routes_embeddings,
                                      routes_messages, routes_models, routes_responses, routes_state, routes_tokenize)
from engine.entrypoints.openai.auth import ApiKeyMiddleware
from engine.entrypoints.openai.context import ServerContext
from engine.entrypoints.openai.cors import CORSMiddleware, allowed_origin_list
from engine.entrypoints.openai.errors import install_error_handlers
from engine.entrypoints.openai.hosts import TrustedHostMiddleware, allowed_host_names
from engine.entrypoints.openai.ignored_fields import HEADER as IGNORED_FIELDS_HEADER, RequestFieldsMiddleware
from engine.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from engine.entrypoints.openai.metrics import ServerMetrics
from engine.entrypoints.openai.responses import ErrorResponse

ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}


def metrics_model_name(served_name: str) -> str:
    """/metrics is open to anyone who can reach the port, so a model served under its folder path is labelled
    by the folder's name: the label identifies the model without telling the directory layout."""
    return Path(served_name).resolve().name if os.path.isdir(served_name) else served_name


def create_app(async_engine: AsyncEngine, served_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="PagedDesk", summary="OpenAI-compatible paged-attention LLM server", version="0.1.0")
    metrics = ServerMetrics(async_engine, metrics_model_name(served_name))
    app.state.ctx = ServerContext(async_engine, served_name, api_key, metrics)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)  # before the body is read: no key, no parsing
    config = async_engine.config
    origins = allowed_origin_list(config.allowed_origins)
    if origins:  # outside the key check: a browser's preflight carries no Authorization header
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=[IGNORED_FIELDS_HEADER])
    app.add_middleware(TrustedHostMiddleware, allowed=allowed_host_names(config.host, config.allowed_hosts))
    app.add_middleware(RequestFieldsMiddleware, strict=config.strict_request_fields)
    app.include_router(routes_models.open_router, responses={503: {"model": ErrorResponse}})
    guarded = dict(responses=ERROR_RESPONSES)  # the key itself is checked by ApiKeyMiddleware
    for module in (routes_models, routes_completions, routes_chat, routes_compact, routes_responses,
                   routes_messages, routes_embeddings, routes_tokenize, routes_state):
        app.include_router(module.router, **guarded)
    return app
