"""CORS for browser front-ends on another origin, off unless `--allowed-origins` names them (vLLM's flag).

Without the flag no CORS headers are sent, so a web page on another origin cannot read replies (the
browser's same-origin rule protects a local server from any site the user visits). With it, Starlette's
CORSMiddleware answers preflight `OPTIONS` requests for those origins (any method, any header, so the
browser may send `Authorization`) before the API-key check, which a preflight cannot pass: browsers send
it without credentials. Credentials mode (cookies) stays off: the API uses bearer tokens.
"""
from __future__ import annotations

import json

from starlette.middleware.cors import CORSMiddleware

__all__ = ["CORSMiddleware", "allowed_origin_list"]


def allowed_origin_list(value: str | None) -> list[str]:
    """`--allowed-origins` as a list: a JSON list (`'["http://a:3000"]'`, as vLLM takes it) or comma-separated."""
    if not value or not value.strip():
        return []
    text = value.strip()
    if text.startswith("["):
        try:
            origins = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--allowed-origins is not a valid JSON list: {exc}") from None
        if not all(isinstance(o, str) for o in origins):
            raise ValueError(f"--allowed-origins must list strings, got {origins!r}")
    else:
        origins = text.split(",")
    return [o.strip().rstrip("/") for o in origins if o.strip()]
