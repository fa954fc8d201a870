"""`pagedesk launch claude|codex|opencode [--model NAME] [--url URL]`: run an agent CLI against a local endpoint.

The endpoint is `--url`, else a server already answering on 127.0.0.1:8000 (the app's and pagedesk-serve's default
port); with `--model` and no server there, `pagedesk-serve --model NAME` is started on a free port and stopped when
the agent exits. The served model's name and context length come from /v1/models, and the agent runs with the
wiring of app/agent_wiring.py (environment and arguments only: the user's own config files are not touched).
Arguments after `--` go to the agent (`pagedesk launch claude -- -p "hello"`). No Qt here: app/main.py dispatches
`launch` before importing any.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.agent_wiring import AGENTS, KEY_ENV, PACKAGES, Endpoint, wiring

DEFAULT_URL = "http://127.0.0.1:8000"
SERVE_START_TIMEOUT_S = 600  # loading a model from disk can take minutes
PROJECT_AGENTS = Path(__file__).resolve().parents[1] / ".work" / "agents" / "node_modules" / ".bin"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(our options, the agent's arguments: everything after `--` and whatever we do not know)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="pagedesk launch", description="Run an agent CLI against PagedDesk")
    parser.add_argument("agent", choices=AGENTS)
    parser.add_argument("--model", help="served model to use; starts pagedesk-serve for it when no server answers")
    parser.add_argument("--url", help=f"endpoint base URL (default: {DEFAULT_URL} if a server answers there)")
    parser.add_argument("--api-key", default=os.environ.get(KEY_ENV),
                        help=f"the server's API key (default: ${KEY_ENV})")
    parser.add_argument("--print-env", action="store_true", help="print the wiring as a shell line; run nothing")
    args, unknown = parser.parse_known_args(argv[:cut])
    return args, unknown + argv[cut + 1:]


def find_endpoint(url: str, api_key: str | None, model: str | None) -> Endpoint | None:
    """The endpoint at `url` if a server answers there (and serves `model`, when given)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        answer = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=3)
        if answer.status_code == 401:
            raise SystemExit(f"pagedesk launch: the server at {url} needs its API key: pass --api-key or set "
                             f"{KEY_ENV}")
        cards = answer.raise_for_status().json()["data"]
    except (httpx.HTTPError, KeyError, ValueError):
        return None
    card = next((c for c in cards if model in (None, c["id"])), None)
    if card is None:
        return None
    return Endpoint(url.rstrip("/"), api_key, card["id"], int(card.get("context_length") or card["max_model_len"]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, api_key: str | None) -> tuple[subprocess.Popen, Endpoint]:
    port = free_port()
    command = [sys.executable, "-m", "engine.entrypoints.serve", "--model", model, "--port", str(port)]
    if api_key:
        command += ["--api-key", api_key]
    print(f"pagedesk launch: starting {' '.join(command[2:])}", file=sys.stderr, flush=True)
    server = subprocess.Popen(command)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + SERVE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"pagedesk launch: pagedesk-serve exited with code {server.returncode}")
        endpoint = find_endpoint(url, api_key, None)
        if endpoint is not None:
            return server, endpoint
        time.sleep(1)
    server.terminate()
    raise SystemExit(f"pagedesk launch: pagedesk-serve did not answer within {SERVE_START_TIMEOUT_S} s")


def agent_binary(agent: str) -> str | None:
    binary = PACKAGES[agent][1]
    local = PROJECT_AGENTS / binary
    return shutil.which(binary) or (str(local) if local.exists() else None)


def main(argv: list[str]) -> int:
    args, passed = parse_args(argv)
    server = None
    endpoint = find_endpoint(args.url or DEFAULT_URL, args.api_key, args.model)
    if endpoint is None and args.url:
        raise SystemExit(f"pagedesk launch: no server answers at {args.url}" +
                         (f" serving {args.model!r}" if args.model else ""))
    if endpoint is None:
        if not args.model:
            raise SystemExit(f"pagedesk launch: no server answers at {DEFAULT_URL}; start one (the app, or "
                             "pagedesk-serve) or pass --model to start one for this session")
        server, endpoint = start_server(args.model, args.api_key)
    try:
        wired = wiring(args.agent, endpoint)
        if args.print_env:
            print(wired.shell(PACKAGES[args.agent][1]))
            return 0
        binary = agent_binary(args.agent)
        if binary is None:
            package = PACKAGES[args.agent][0]
            raise SystemExit(f"pagedesk launch: {PACKAGES[args.agent][1]!r} is not installed; install it with "
                             f"`npm install -g {package}`")
        return subprocess.call([binary, *wired.args, *passed], env={**os.environ, **wired.env})
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
