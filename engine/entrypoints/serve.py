"""pagedesk-serve / `python -m engine.entrypoints.serve`: parse vLLM-style flags, start the server, load the model behind it.

With several models (`--model NAME=PATH` repeated, `--models-dir`, `--models-config`), replicas
(`--data-parallel-size N`) or a router flag (`--model-ttl`, `--max-loaded-models`, `--memory-budget`),
`main` runs the router instead (engine/entrypoints/router): one endpoint in front of one engine process per replica,
each of them this very program. What follows is the one-engine server.

The port is bound before anything loads (a taken port is a one-line error, not a wasted model load);
the HTTP server listens first (/health answers 503 while loading); the model loads in the engine
thread. When both are up it prints "PagedDesk serving <name> at http://host:port/v1" (<name>: --served-model-name,
else the folder's name or the hub repo id). SIGTERM/SIGINT end every stream in-band (an error event, then
[DONE]) before the server stops, and the process exits within about a second. Exit codes tell a
supervisor what happened: 2 for a configuration error (one line, no traceback), 3 for out of memory
at load (do not restart), 1 for any other load failure, 4 when the engine died or a step got stuck
while serving (after answering 503 for a short grace period, so clients see why; a supervisor
restarts it), 0 after a clean shutdown. At start the soft open-file limit is raised to the hard one and
connections are capped below it, with a header-read timeout (server/connection_guard.py).
`--exit-with-parent PID` (what the desktop app passes) ends the process when PID, its parent, dies —
however it dies (engine/distributed/parent_watch.py).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import resource
import signal
import sys
import threading
import time

from engine.config.flags import ROUTER_FLAGS, ROUTER_FLAGS_BY_NAME, EngineConfig, add_flags
from engine.entrypoints.serving_process import (EXIT_CONFIG_ERROR, EXIT_ENGINE_DIED, EXIT_LOAD_FAILED, EXIT_OUT_OF_MEMORY,
                                                bind_socket_or_say, stop_quietly)

DEAD_GRACE_S = 2.0  # /health answers 503 this long before the process exits
FD_MARGIN = 128  # file descriptors kept for model files, pipes and workers below the connection cap
MAX_CONNECTIONS = 8192
STREAM_END_GRACE_S = 2.5  # on SIGTERM, the most streams get to send their in-band end (under uvicorn's 3)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedesk-serve",
                                     description="Serve a model over an OpenAI-compatible HTTP API.")
    add_flags(parser)
    add_flags(parser, ROUTER_FLAGS)
    return parser


def split_model_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """Every `--model VALUE` (it may be repeated: one per model), and the other arguments."""
    models, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--model" and i + 1 < len(argv):
            models.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--model="):
            models.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return models, rest


def parse_config(argv: list[str] | None = None) -> EngineConfig:
    """Parse and validate flags; raises SystemExit(2) (argparse) or ValueError with a one-line reason."""
    return engine_config(vars(build_parser().parse_args(argv)))


def engine_config(args: dict) -> EngineConfig:
    """One engine's configuration from parsed flags (`--model NAME=PATH` serves PATH under NAME)."""
    from engine.entrypoints.router.specs import split_model_arg

    kwargs = {k: v for k, v in args.items() if k not in ROUTER_FLAGS_BY_NAME}
    if kwargs.get("model"):
        name, kwargs["model"] = split_model_arg(kwargs["model"])
        kwargs["served_model_name"] = kwargs.get("served_model_name") or name
    config = EngineConfig.from_kwargs(**kwargs, serving=True)
    if not config.model:
        raise ValueError("--model is required: a Hugging Face model folder or hub repo id")
    config.validate()
    return config


def is_out_of_memory(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, MemoryError) or "outofmemory" in text or "out of memory" in text


def load_exit(exc: BaseException) -> tuple[int, str]:
    """Exit code and one-line message for a failed model load."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    if is_out_of_memory(exc):
        return EXIT_OUT_OF_MEMORY, f"error: out of memory while loading the model: {first_line}"
    if isinstance(exc, (ValueError, FileNotFoundError, OSError)):
        return EXIT_CONFIG_ERROR, f"error: cannot load the model: {first_line}"
    return EXIT_LOAD_FAILED, f"error: loading the model failed: {type(exc).__name__}: {first_line}"


def _say(line: str) -> None:
    print(line, flush=True)


def _watch(server, async_engine, config: EngineConfig, name: str, outcome: dict) -> None:
    """Announce readiness once both the socket and the model are up; stop the server if the load failed."""
    async_engine.wait_until_loaded()
    if async_engine.load_error is not None:
        outcome["code"], outcome["message"] = load_exit(async_engine.load_error)
        server.should_exit = True
        return
    stats = async_engine.stats
    _say(f"Model loaded in {async_engine.load_seconds:.1f} s ({stats.num_blocks} KV-cache blocks of "
         f"{stats.block_size} tokens)")
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if server.started:
        _say(f"PagedDesk serving {name} at http://{config.host}:{config.port}/v1")
    while async_engine.status == "ready" and not server.should_exit:
        time.sleep(0.1)
    if async_engine.status == "dead" and not server.should_exit:
        outcome["code"] = EXIT_ENGINE_DIED
        outcome["message"] = f"error: the engine died while serving: {async_engine.error}"
        print(outcome["message"], file=sys.stderr, flush=True)
        time.sleep(DEAD_GRACE_S)
        server.should_exit = True


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (a connection flood must not run out of descriptors at
    the default 1024); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # e.g. a hard limit above the kernel's nr_open: keep what we have
            pass
    return soft


def max_connections_for(open_file_limit: int) -> int:
    from engine.entrypoints.openai.connection_guard import RESERVED_FOR_PROBES
    return max(4 * RESERVED_FOR_PROBES, min(open_file_limit - FD_MARGIN, MAX_CONNECTIONS))


def _writing_response(connection) -> bool:
    cycle = getattr(connection, "cycle", None)
    return cycle is not None and not cycle.response_complete and getattr(connection, "transport", None) is not None


def _write_paused(connection) -> bool:
    return bool(getattr(getattr(connection, "flow", None), "write_paused", False))


def uvicorn_config(app, host: str, port: int, guard) -> "uvicorn.Config":
    """uvicorn's config for our app: its HTTP protocol behind the connection guard (cap, header timeout)."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=3, http=guard.protocol_factory(AutoHTTPProtocol))


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that, on SIGTERM/SIGINT, first ends every engine stream with an in-band error so
        clients learn why and the graceful shutdown finds no connection left to cut."""

        def __init__(self, config: "uvicorn.Config", async_engine) -> None:
            super().__init__(config)
            self.async_engine = async_engine

        def handle_exit(self, sig: int, frame: object) -> None:
            self.async_engine.stop_serving()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            await self._drop_unread_streams()
            await super().shutdown(sockets)

        async def _drop_unread_streams(self) -> None:
            """Every stream has been told to end; one whose client is not reading (its writes are paused on
            a full socket) cannot send that end, and uvicorn would cancel it after its graceful timeout (a
            CancelledError traceback in the log). Once only such streams are left, or the grace is over,
            drop those connections: a reading client still gets its in-band end."""
            loop = asyncio.get_running_loop()
            deadline = loop.time() + STREAM_END_GRACE_S
            while loop.time() < deadline:
                writing = [c for c in self.server_state.connections if _writing_response(c)]
                if all(_write_paused(c) for c in writing):
                    break
                await asyncio.sleep(0.05)
            for connection in list(self.server_state.connections):
                if _writing_response(connection) and _write_paused(connection):
                    connection.transport.abort()

    return Server


def serve(config: EngineConfig) -> int:
    from engine.config.model_discovery import default_model_name
    from engine.entrypoints.async_engine import AsyncEngine
    from engine.entrypoints.openai.app import create_app
    from engine.entrypoints.openai.connection_guard import ConnectionGuard

    sock = bind_socket_or_say(config.host, config.port)
    if sock is None:
        return EXIT_CONFIG_ERROR
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    name = config.served_model_name or default_model_name(config.model)
    async_engine = AsyncEngine(config)
    app = create_app(async_engine, name, config.api_key)
    guard = ConnectionGuard(max_connections_for(raise_open_file_limit()))
    server = _server_class()(uvicorn_config(app, config.host, config.port, guard), async_engine)
    outcome: dict = {"code": 0, "message": None}
    _say(f"Loading {config.model} (device {config.device}, dtype {config.dtype}, "
         f"tensor parallel {config.tensor_parallel_size}) ...")
    async_engine.start()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop_quietly) for sig in (signal.SIGINT, signal.SIGTERM)}
    threading.Thread(target=_watch, args=(server, async_engine, config, name, outcome), daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        async_engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if outcome["message"] and outcome["code"] != EXIT_ENGINE_DIED:  # that one was said when it happened
        print(outcome["message"], file=sys.stderr, flush=True)
    # The interpreter's exit collects every object torch, transformers and the model left behind: seconds of
    # garbage collection after a SIGTERM, past a supervisor's grace period. Nothing of it needs collecting.
    gc.freeze()
    return outcome["code"]


def main(argv: list[str] | None = None) -> int:
    """One engine for one model; the router (engine/entrypoints/router) in front of engines for several models or replicas."""
    from engine.distributed.parent_watch import die_with_parent, split_parent_flag
    from engine.entrypoints.router.specs import build_specs, wants_router

    try:
        parent_pid, argv = split_parent_flag(list(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    if parent_pid is not None:  # first, so a parent that dies while the model loads still takes us with it
        if os.getppid() != parent_pid:
            print(f"error: --exit-with-parent {parent_pid}: that process is not this one's parent "
                  f"(the parent is {os.getppid()}); not serving", file=sys.stderr, flush=True)
            return EXIT_CONFIG_ERROR
        die_with_parent(parent_pid)
    models, rest = split_model_flags(argv)
    try:
        args = vars(build_parser().parse_args(rest))
        if wants_router(models, args):
            from engine.entrypoints.router.main import serve_router
            router_config = build_specs(models, args)
        else:
            args["model"] = models[-1] if models else None
            config = engine_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    if wants_router(models, args):
        return serve_router(router_config)
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
