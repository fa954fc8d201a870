"""A real uvicorn server on 127.0.0.1 (ephemeral port) in a background thread, for the server tests.

`start_server(model_dir, ...)` builds the AsyncEngine and app exactly as `pagedesk-serve` does, waits
until the socket listens and the model has loaded, and returns a handle whose `stop()` shuts both down;
`access_records()` collects the requests such a server answered (method, path, status).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

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
                 access_log: bool = False, **overrides) -> RunningServer:
    """`access_log`: uvicorn logs each request (method, path, status), which `access_records` collects."""
    config = tiny_config(model_dir, api_key=api_key, **overrides)
    async_engine = AsyncEngine(config, engine_factory)
    app = create_app(async_engine, MODEL_NAME, api_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, access_log=access_log,
                                           log_level="info" if access_log else "warning", timeout_graceful_shutdown=2))
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


@dataclass
class AccessRecord:
    method: str
    path: str
    status: int


@contextmanager
def access_records() -> Iterator[list[AccessRecord]]:
    """The requests a server started with access_log=True answered while the block ran (uvicorn's access log)."""
    records: list[AccessRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _client, method, path, _version, status = record.args
            records.append(AccessRecord(method, path.split("?")[0], int(status)))

    handler, logger = Collect(), logging.getLogger("uvicorn.access")
    # Every uvicorn.Config sets this logger's level (log_level="warning" for the other test servers): a server
    # made later in the session must not silence the one read here.
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)



@contextmanager
def token_by_token() -> Iterator[None]:
    """Every streamed token its own chunk: the engine steps a request only once its reader took the previous output
    (AsyncEngine's unread-output pause at 1 instead of MAX_UNREAD_OUTPUTS). Outputs are cumulative, so an engine
    that outruns the event loop hands several tokens in one chunk; a test that measures the gaps between chunks
    (inter-token latencies) forces one per token this way, on any machine, instead of hoping the engine is slow."""
    from engine.entrypoints import async_engine
    kept = async_engine.MAX_UNREAD_OUTPUTS
    async_engine.MAX_UNREAD_OUTPUTS = 1
    try:
        yield
    finally:
        async_engine.MAX_UNREAD_OUTPUTS = kept
