"""Run the router: bind the public port, check every model's flags and config, serve until SIGTERM/SIGINT.

Nothing loads at start: engines start on the first request for their model (or POST /v1/models/NAME/load). A
model whose folder holds a broken config.json is served as failed (503 with the reason) beside the others.
It prints "PagedDesk serving N models at http://host:port/v1: names" once it listens. On SIGTERM/SIGINT every
engine gets SIGTERM at once (its streams end in-band, relayed to the clients), the HTTP server closes, and
the lifespan's shutdown waits for each engine, killing any that outlive the grace period; a last sweep kills
whatever process group is still there, so the router leaves no process behind. Exit codes as pagedesk-serve:
2 for a configuration error (one line), 0 after a clean shutdown.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from engine.entrypoints.router.specs import RouterConfig
from engine.entrypoints.serving_process import EXIT_CONFIG_ERROR, bind_socket_or_say, stop_quietly


def check_models(config: RouterConfig) -> dict[str, str]:
    """Every model's flags validate and its folder (or hub repo) can be found, else ValueError naming the model:
    the command line is wrong. A model whose folder is there but cannot be served (a broken or unsupported
    config.json) is the folder's problem, not the command line's: it is returned ({name: why}) to be served as
    failed beside the others, and tried again once its folder changes; only when no model is left is it an
    error. A model found under --models-dir that cannot be served is left out with a warning instead: the
    folder may hold anything."""
    broken = {}
    for spec in list(config.models.values()):
        try:
            why = _folder_problem(spec)
        except ValueError as exc:
            if not spec.discovered:
                raise
            why = str(exc)
        if why is None:
            continue
        if spec.discovered:
            print(f"warning: not serving {spec.name} from --models-dir: {why}", file=sys.stderr, flush=True)
            del config.models[spec.name]
        else:
            broken[spec.name] = why
    if not config.models:
        raise ValueError("no servable model: --models-dir holds none this engine supports")
    if len(broken) == len(config.models):
        raise ValueError("; ".join(broken.values()))
    for why in broken.values():
        print(f"warning: serving it as failed until its folder changes: {why}", file=sys.stderr, flush=True)
    return broken


def _folder_problem(spec) -> str | None:
    """Why the model's folder cannot be served, None when it can; ValueError when its flags or path are wrong."""
    from engine.config.model import ModelConfig
    from engine.entrypoints.router.placement import model_folder

    def named(message: str) -> str:
        return message if spec.name in message else f"model {spec.name}: {message}"

    try:
        engine_config = spec.engine_config()
        folder = model_folder(spec)
    except ValueError as exc:
        raise ValueError(named(str(exc))) from None
    try:
        ModelConfig.from_folder(folder, engine_config.quantization).with_max_model_len(engine_config.max_model_len)
    except (OSError, KeyError, ValueError) as exc:
        return named(str(exc) if isinstance(exc, ValueError) else f"cannot read {spec.path}: {exc}")
    return None


def _server_class():
    import uvicorn

    class RouterServer(uvicorn.Server):
        def __init__(self, config: "uvicorn.Config", manager) -> None:
            super().__init__(config)
            self.manager = manager

        def handle_exit(self, sig: int, frame: object) -> None:
            self.manager.signal_all(signal.SIGTERM)  # streams end in-band now, not after the HTTP drain
            self.manager.stopping = True
            super().handle_exit(sig, frame)

    return RouterServer


def serve_router(config: RouterConfig) -> int:
    import uvicorn

    from engine.entrypoints.router.app import create_router_app
    from engine.entrypoints.router.manager import ModelManager
    from engine.entrypoints.router.placement import detect_cards

    try:
        broken = check_models(config)
        cards = detect_cards(config.device, config.memory_budget, config.gpu_memory_utilization)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    sock = bind_socket_or_say(config.host, config.port)
    if sock is None:
        return EXIT_CONFIG_ERROR
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per relayed request otherwise
    manager = ModelManager(config, cards, broken)
    app = create_router_app(manager)
    server = _server_class()(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                            access_log=False, timeout_graceful_shutdown=15), manager)
    names = ", ".join(config.models)
    where = ", ".join(f"{c.name} {c.budget_bytes / 1024 ** 3:.1f} GiB" for c in cards)

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            print(f"PagedDesk serving {len(config.models)} model(s) at http://{config.host}:{config.port}/v1: "
                  f"{names} (placing engines on {where})", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop_quietly) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        manager.signal_all(signal.SIGKILL)  # the last sweep: nothing outlives the router
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
