"""A real uvicorn server on 127.0.0.1 (ephemeral port) in a background thread, for the server tests.

`start_server(model_dir, ...)` builds the AsyncEngine and app exactly as `pagedesk-serve` does, waits
until the socket listens and the model has loaded, and returns a handle whose `stop()` shuts both down.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import uvicorn

from engine.entrypoints.async_engine import AsyncEngine
from engine.config.flags import EngineConfig
from engine.entrypoints.openai.app import create_app

MODEL_NAME = "tiny"
AGENT_API_KEY = "sk-local"  # conftest's agent_api_server (Responses and Messages tests)


@dataclass
class RunningServer:
    server: uvicorn.Server
    thread: threading.Thread
    async_engine: AsyncEngine
    app: object
    port: int
    api_key: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.async_engine.shutdown()


def tiny_config(model_dir, **overrides) -> EngineConfig:
    values = dict(model=str(model_dir), served_model_name=MODEL_NAME, device="cpu", max_model_len=256,
                  num_gpu_blocks_override=512, max_num_seqs=128, seed=0)
    values.update(overrides)
    return EngineConfig.from_kwargs(**values)


def start_server(model_dir, api_key: str | None = None, wait_loaded: bool = True, engine_factory=None,
                 **overrides) -> RunningServer:
    config = tiny_config(model_dir, api_key=api_key, **overrides)
    async_engine = AsyncEngine(config, engine_factory)
    app = create_app(async_engine, MODEL_NAME, api_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    async_engine.start()
    if wait_loaded:
        assert async_engine.wait_until_loaded(120), "model did not load"
    return RunningServer(server, thread, async_engine, app, port, api_key)
