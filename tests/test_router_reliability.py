"""The router under faults (issue 34): a stopped engine, an unload under a running stream, a model that cannot
load, a broken config.json among good ones, and the host memory an engine process takes.

The router runs in this process (uvicorn in a thread, as `pagedesk-serve` would run it), so a test can shorten
the drain timeout; its engines are real `pagedesk-serve` subprocesses of a tiny random Llama. Models: `a` (long
context, so a stream is long by construction), `corrupt` (its weights file is garbage: the engine exits while
loading) and `broken` (its config.json is not JSON). Each wait is bounded; the liveness target (a stopped engine
seen within 10 s) is checked on the constants, not on a clock.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import httpx
import pytest
import uvicorn

from engine.entrypoints import serve
from engine.entrypoints.router import liveness
from engine.entrypoints.router import manager as manager_module
from engine.entrypoints.router.app import create_router_app
from engine.entrypoints.router.backend import EngineProcess
from engine.entrypoints.router.main import check_models
from engine.entrypoints.router.manager import ModelManager
from engine.entrypoints.router.placement import CPU_PROCESS_BYTES, detect_cards
from engine.entrypoints.router.specs import build_specs

KEY = "reliab-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
pytestmark = pytest.mark.timeout(300)


class RouterHandle:
    def __init__(self, manager: ModelManager, server: uvicorn.Server, thread: threading.Thread):
        self.manager, self.server, self.thread = manager, server, thread
        self.url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        self.starts: list[str] = []  # model name of every engine start, in order


@pytest.fixture(scope="module")
def router(tiny_model_dir, tmp_path_factory):
    good = tiny_model_dir("llama", max_position_embeddings=4096)
    root = tmp_path_factory.mktemp("reliab")
    corrupt, broken = shutil.copytree(good, root / "corrupt"), shutil.copytree(good, root / "broken")
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    (broken / "config.json").write_text("{not json")
    models, rest = serve.split_model_flags(["--model", f"a={good}", "--model", f"corrupt={corrupt}", "--model",
                                            f"broken={broken}", "--device", "cpu", "--num-gpu-blocks-override",
                                            "300", "--api-key", KEY])
    config = build_specs(models, vars(serve.build_parser().parse_args(rest)))
    manager = ModelManager(config, detect_cards("cpu", None, 0.9), check_models(config))
    server = uvicorn.Server(uvicorn.Config(create_router_app(manager), host="127.0.0.1", port=0,
                                           log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="router-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the router did not start"
        time.sleep(0.01)
    handle = RouterHandle(manager, server, thread)
    original = EngineProcess._start_once

    async def counted(self, timeout_s):
        handle.starts.append(self.spec.name)
        return await original(self, timeout_s)

    EngineProcess._start_once = counted
    try:
        yield handle
    finally:
        EngineProcess._start_once = original
        server.should_exit = True
        thread.join(60)


def card(router, name: str) -> dict:
    data = httpx.get(router.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]
    return next(m for m in data if m["id"] == name)


def complete(router, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(router.url + "/v1/completions", json=body, headers=AUTH, timeout=240)


def events(lines):
    """The data events of an SSE stream, parsed; `[DONE]` as None."""
    for line in lines:
        if line.startswith("data: "):
            yield None if line[6:] == "[DONE]" else json.loads(line[6:])


def test_a_broken_config_among_several_is_failed_and_the_others_serve(router):
    broken = card(router, "broken")
    assert broken["state"] == "failed" and "broken" in broken["error"], broken
    r = complete(router, "broken")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    assert r.json()["error"]["message"] == broken["error"]
    assert "broken" not in router.starts  # answered from the failure: no engine was started for it
    assert complete(router, "a").status_code == 200
    assert card(router, "a")["state"] == "loaded"


def test_the_engine_process_baseline_is_measured(router):
    """After `a` started, placement counts what its process holds, measured (not the default, not zero)."""
    assert router.manager._measured and router.manager.process_bytes > 0
    assert router.manager.process_bytes != CPU_PROCESS_BYTES


def test_a_model_that_cannot_load_is_started_once_not_per_request(router):
    first = complete(router, "corrupt")
    assert first.status_code == 503 and first.json()["error"]["code"] == "model_load_failed"
    assert router.starts.count("corrupt") == 1
    for _ in range(3):  # answered at once with the same reason: no new engine
        again = complete(router, "corrupt")
        assert again.status_code == 503 and again.json()["error"]["message"] == first.json()["error"]["message"]
    assert router.starts.count("corrupt") == 1
    corrupt = card(router, "corrupt")
    assert corrupt["state"] == "failed" and corrupt["error"] == first.json()["error"]["message"]
    # The folder changes (a new weights file): the next request tries again.
    folder = router.manager.entries["corrupt"].spec.path
    with open(os.path.join(folder, "model.safetensors"), "ab") as weights:
        weights.write(b"more garbage")
    assert complete(router, "corrupt").status_code == 503
    assert router.starts.count("corrupt") == 2


def test_a_stopped_engine_is_seen_its_requests_fail_in_band_and_it_restarts(router):
    assert liveness.HUNG_AFTER_S + liveness.PROBE_INTERVAL_S <= 10  # the target, by construction
    assert complete(router, "a").status_code == 200
    pid = card(router, "a")["engines"][0]["pid"]
    with httpx.Client(timeout=httpx.Timeout(240, read=60)) as client:
        body = {"model": "a", "prompt": "w5 w6", "max_tokens": 3800, "ignore_eos": True, "stream": True}
        with client.stream("POST", router.url + "/v1/completions", json=body, headers=AUTH) as stream:
            lines = stream.iter_lines()
            assert next(events(lines))["choices"]
            os.kill(pid, signal.SIGSTOP)
            try:
                rest = list(events(lines))
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)  # if the router did not kill it, let the fixture stop it
                except ProcessLookupError:
                    pass
    assert rest[-1] is None and "error" in rest[-2], rest[-3:]
    error = rest[-2]["error"]
    assert error["code"] == "engine_dead" and "stopped answering" in error["message"], error
    r = complete(router, "a")  # waits for the restart in progress
    assert r.status_code == 200, r.text
    a = card(router, "a")
    assert a["state"] == "loaded" and a["engines"][0]["pid"] != pid


def test_unload_waits_for_a_running_stream(router):
    """An unload during a stream lets it finish, then stops the engine."""
    with httpx.Client(timeout=240) as client:
        body = {"model": "a", "prompt": "w5 w6", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with client.stream("POST", router.url + "/v1/completions", json=body, headers=AUTH) as stream:
            lines = stream.iter_lines()
            first = next(events(lines))
            assert first["choices"]
            unload = threading.Thread(target=lambda: httpx.post(router.url + "/v1/models/a/unload", headers=AUTH,
                                                                timeout=120))
            unload.start()
            deadline = time.monotonic() + 60
            while not router.manager.entries["a"].unloading:  # the unload has begun, the stream is not read yet
                assert time.monotonic() < deadline and unload.is_alive(), "the unload did not wait for the stream"
                time.sleep(0.01)
            rest = list(events(lines))
    unload.join(120)
    assert rest[-1] is None and not any(e and "error" in e for e in rest), rest[-3:]
    assert rest[-2]["choices"][0]["finish_reason"] == "length"
    assert card(router, "a")["state"] == "unloaded"


def test_unload_past_the_drain_timeout_says_the_model_was_unloaded(router, monkeypatch):
    monkeypatch.setattr(manager_module, "DRAIN_TIMEOUT_S", 0.5)
    with httpx.Client(timeout=240) as client:
        body = {"model": "a", "prompt": "w5 w6", "max_tokens": 3800, "ignore_eos": True, "stream": True}
        with client.stream("POST", router.url + "/v1/completions", json=body, headers=AUTH) as stream:
            lines = stream.iter_lines()
            assert next(events(lines))["choices"]
            r = httpx.post(router.url + "/v1/models/a/unload", headers=AUTH, timeout=120)
            rest = list(events(lines))
    assert r.status_code == 200 and r.json()["state"] == "unloaded"
    assert rest[-1] is None and "error" in rest[-2], rest[-3:]
    error = rest[-2]["error"]
    assert error["code"] == "model_unloaded" and "model a was unloaded" in error["message"], error
