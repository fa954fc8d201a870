"""A stand-in for `python -m engine.entrypoints.serve` used by the supervisor and client tests (stdlib only).

Serves /health, a short streamed chat completion and the engine-state stream with synthetic blocks,
so the GUI's process handling and HTTP clients can be tested in seconds without torch. Behaviour is
chosen by environment variables: FAKE_SERVE_MODE=ok|oom|config|exit1|ignore_term|refuse, FAKE_SERVE_DELAY
(seconds before listening), FAKE_SERVE_TOKEN_DELAY (seconds between streamed words),
FAKE_SERVE_CHILD_PID_FILE (spawn a child in the same process group and write its pid there, like a
tensor-parallel worker). POST /tokenize counts a chat as words (FAKE_SERVE_MAX_MODEL_LEN,
default 4096, is its context; a chat completion that would not fit is refused with 400 as the real
server does; FAKE_SERVE_REQUEST_LOG appends each chat request's body as a JSON line). Started as the router
would be (several `--model`, or `--model-ttl`), GET /v1/models lists every model by the name the router gives
it, the first with the router's per-model `state`: "loading" for FAKE_SERVE_LOAD_S seconds, then "loaded"; in
mode `refuse` "failed" with an engine error. Started as one engine, it lists its one model without a state and
answers /health 503 "model_loading" for those seconds. In mode `refuse` every completion for the main model is a
503 with that error (an engine that cannot serve it). POST /v1/completions answers one token, as the app's
readiness probe asks. `--exit-with-parent PID` arms engine/distributed/parent_watch.py
exactly as the real server does. Other engine flags are accepted and ignored.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

NUM_BLOCKS = 256
REFUSED = "engine exited with code 2: speculative_config.method \"mtp\": the checkpoint has no MTP weights"
STARTED = time.monotonic()


def state_payload(tick: int) -> dict:
    n = NUM_BLOCKS
    used = 8 + tick % 40
    state = bytes([1] * used + [2] * 10 + [0] * (n - used - 10))
    ref = bytes([2 if i < 4 else 1 for i in range(used)] + [0] * (n - used))
    owner = b"".join(((1 + i // 16) if i < used else 0).to_bytes(2, "little") for i in range(n))
    requests = [{"id": f"cmpl-{k}", "status": "running", "num_blocks": 16} for k in range(1 + (used - 1) // 16)]
    return {"time": time.time(), "model": "fake-model", "device": "cpu", "block_size": 16, "num_blocks": n,
            "blocks": base64.b64encode(zlib.compress(state + ref + owner)).decode(), "requests": requests,
            "num_running": len(requests), "num_waiting": tick % 3, "kv_cache_usage": used / n,
            "prefix_cache_hit_rate": 0.25, "num_preemptions": 0, "prompt_tokens_total": 100 + tick,
            "generation_tokens_total": 10 * tick, "prompt_tokens_per_s": 50.0, "generation_tokens_per_s": 20.0 + tick,
            "memory": {"weights_bytes": 123456, "kv_cache_bytes": 654321}}


def fake_token_count(messages: list[dict]) -> int:
    """The fake's tokenizer: one token per word, four per message for the template, two for the reply prompt."""
    return sum(len(str(m.get("content", "")).split()) + 4 for m in messages) + 2


def max_model_len() -> int:
    return int(os.environ.get("FAKE_SERVE_MAX_MODEL_LEN", "4096"))


def model_names(models: list[str], served_name: str | None) -> list[str]:
    """Names as the router gives them: NAME=PATH by NAME, the main model by --served-model-name or its folder."""
    from engine.config.model_discovery import default_model_name  # stdlib only; PYTHONPATH has the repository

    names = [m.split("=", 1)[0] if "=" in m and "/" not in m.split("=", 1)[0] else default_model_name(m)
             for m in models or ["model"]]
    if served_name:
        names[0] = served_name
    return names


def main_state() -> str:
    if os.environ.get("FAKE_SERVE_MODE") == "refuse":
        return "failed"
    return "loading" if time.monotonic() - STARTED < float(os.environ.get("FAKE_SERVE_LOAD_S", "0")) else "loaded"


class Handler(BaseHTTPRequestHandler):
    api_key: str | None = None
    models: list[str] = ["model"]
    router = False  # started with the router's flags: per-model states in /v1/models, /health up at once

    def log_message(self, fmt, *args):  # noqa: N802 - keep test output quiet but visible in the log tail
        sys.stdout.write("fake-serve: " + fmt % args + "\n")

    def _authorized(self) -> bool:
        if self.api_key and self.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "bad api key"}}')
            return False
        return True

    def _start_sse(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

    def _event(self, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def do_GET(self):  # noqa: N802
        url = urlparse(self.path)
        if url.path == "/health":
            if not self.router and main_state() == "loading":
                self._json(503, {"error": {"message": "the model is still loading", "code": "model_loading"}})
                return
            self.send_response(200)
            self.end_headers()
            return
        if url.path == "/v1/models" and self._authorized():
            state = main_state()
            cards = [{"id": name, "object": "model", "max_model_len": max_model_len(),
                      **({"state": state, "loaded": state == "loaded",
                          "engines": [{"index": 0, "state": state, "error": REFUSED if state == "failed" else None,
                                       "devices": "cpu", "memory_bytes": 1 << 20}]} if i == 0 else
                         {"state": "unloaded", "loaded": False, "engines": []})}
                     if self.router else {"id": name, "object": "model", "max_model_len": max_model_len()}
                     for i, name in enumerate(self.models)]
            self._json(200, {"object": "list", "data": cards})
            return
        if url.path == "/v1/engine/state/stream" and self._authorized():
            hz = float(parse_qs(url.query).get("hz", ["4"])[0])
            self._start_sse()
            try:
                for tick in range(100000):
                    self._event(state_payload(tick))
                    time.sleep(1 / hz)
            except (BrokenPipeError, ConnectionResetError):
                return
        self.send_response(404)
        self.end_headers()

    def _json(self, code: int, obj: dict) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(obj).encode())

    def do_POST(self):  # noqa: N802
        path = urlparse(self.path).path
        if path not in ("/v1/chat/completions", "/tokenize", "/v1/completions") or not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if body.get("model") == self.models[0] and main_state() == "failed":
            self._json(503, {"error": {"message": REFUSED, "type": "ServiceUnavailableError", "code": "engine_dead"}})
            return
        if path == "/v1/completions":
            self._json(200, {"id": "cmpl-probe", "object": "text_completion", "model": body.get("model"),
                             "choices": [{"index": 0, "text": " hi", "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
            return
        if path == "/tokenize":
            self._json(200, {"count": fake_token_count(body.get("messages") or []), "max_model_len": max_model_len(),
                             "tokens": []})
            return
        if os.environ.get("FAKE_SERVE_REQUEST_LOG"):
            with open(os.environ["FAKE_SERVE_REQUEST_LOG"], "a") as log:
                log.write(json.dumps(body) + "\n")
        prompt, completion = fake_token_count(body.get("messages") or []), int(body.get("max_tokens") or 16)
        if prompt + completion > max_model_len():
            self._json(400, {"error": {"message": f"requested {prompt + completion} tokens ({prompt} prompt, "
                                                  f"{completion} completion), the context holds {max_model_len()}",
                                       "type": "BadRequestError"}})
            return
        if body.get("model") == "fail-400":  # the request's model name picks a failure, for the chat tests
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "max_tokens must be at least 1, got 0", "type": "x"}}')
            return
        words = ["Hello", " from", " the", " fake", " engine", ".\n\n```python\nprint('hi')\n```"]
        self._start_sse()
        try:
            for i, word in enumerate(words[: body.get("max_tokens", 16)]):
                if i == 2 and body.get("model") == "die-midway":
                    return  # connection closes without a finish reason or [DONE], like a killed engine
                if i == 2 and body.get("model") == "error-midway":
                    self._event({"error": {"message": "the engine died while serving", "type": "internal_error"}})
                    return
                self._event({"id": "cmpl-1", "object": "chat.completion.chunk", "model": body.get("model"),
                             "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]})
                time.sleep(float(os.environ.get("FAKE_SERVE_TOKEN_DELAY", "0.02")))
            self._event({"id": "cmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            self._event({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6,
                                                                       "total_tokens": 11}})
            self._event("[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key")
    parser.add_argument("--exit-with-parent", type=int)
    parser.add_argument("--model", action="append")
    parser.add_argument("--served-model-name")
    parser.add_argument("--model-ttl")
    args, _unknown = parser.parse_known_args()
    if args.exit_with_parent:
        from engine.distributed.parent_watch import die_with_parent  # stdlib only; PYTHONPATH has the repository

        die_with_parent(args.exit_with_parent)
    mode = os.environ.get("FAKE_SERVE_MODE", "ok")
    print(f"fake-serve: starting in mode {mode} on {args.host}:{args.port}", flush=True)
    if mode == "oom":
        print("RuntimeError: CUDA out of memory while loading weights (tried to allocate 2.00 GiB)", flush=True)
        sys.exit(3)
    if mode == "config":
        print("error: cannot load the model: no *.safetensors weights in /m", file=sys.stderr, flush=True)
        sys.exit(2)
    if mode == "exit1":
        print("fake-serve: failing on purpose", flush=True)
        sys.exit(1)
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, lambda *_: print("fake-serve: ignoring SIGTERM", flush=True))
    child_file = os.environ.get("FAKE_SERVE_CHILD_PID_FILE")
    if child_file:
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        with open(child_file, "w") as f:
            f.write(str(child.pid))
    time.sleep(float(os.environ.get("FAKE_SERVE_DELAY", "0")))
    Handler.api_key = args.api_key
    Handler.models = model_names(args.model, args.served_model_name)
    Handler.router = len(Handler.models) > 1 or args.model_ttl is not None
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print("fake-serve: ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
