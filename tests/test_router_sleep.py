"""The router's sleep mode: `--model-ttl-action sleep` puts an idle model's engines to sleep (level 1) instead of
stopping them, the next request wakes them (same process, same greedy output); POST /v1/models/NAME/sleep?level=
and /wake_up do it by hand; /v1/models says `sleeping`. The router runs in this process, its engine is a real
`pagedesk-serve` subprocess of a tiny random Llama.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from engine.entrypoints import serve
from engine.entrypoints.router.app import create_router_app
from engine.entrypoints.router.main import check_models
from engine.entrypoints.router.manager import ModelManager
from engine.entrypoints.router.placement import detect_cards
from engine.entrypoints.router.specs import build_specs

KEY = "sleep-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
pytestmark = pytest.mark.timeout(300)


def specs(*argv: str):
    models, rest = serve.split_model_flags(list(argv))
    return build_specs(models, vars(serve.build_parser().parse_args(rest)))


def test_the_ttl_action_is_a_router_flag_per_model(tmp_path, llama_dir):
    toml = tmp_path / "models.toml"
    toml.write_text("[models.b]\nmodel-ttl-action = \"unload\"\n")
    config = specs("--model", f"a={llama_dir}", "--model", f"b={llama_dir}", "--models-config", str(toml),
                   "--model-ttl", "5", "--model-ttl-action", "sleep")
    assert config.models["a"].model_ttl_action == "sleep" and config.models["b"].model_ttl_action == "unload"
    assert "model_ttl_action" not in config.models["a"].engine_flags
    toml.write_text("[models.b]\nmodel-ttl-action = \"nap\"\n")
    with pytest.raises(ValueError, match="--model-ttl-action must be one of unload, sleep"):
        specs("--model", f"a={llama_dir}", "--model", f"b={llama_dir}", "--models-config", str(toml))


@pytest.fixture(scope="module")
def router(tiny_model_dir):
    config = specs("--model", f"a={tiny_model_dir('llama')}", "--device", "cpu", "--num-gpu-blocks-override", "64",
                   "--api-key", KEY, "--model-ttl", "1", "--model-ttl-action", "sleep")
    manager = ModelManager(config, detect_cards("cpu", None, 0.9), check_models(config))
    server = uvicorn.Server(uvicorn.Config(create_router_app(manager), host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="router-sleep-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the router did not start"
        time.sleep(0.01)
    server.url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.manager = manager
    yield server
    server.should_exit = True
    thread.join(60)


def card(router) -> dict:
    return httpx.get(router.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]


def complete(router) -> str:
    body = {"model": "a", "prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(router.url + "/v1/completions", json=body, headers=AUTH, timeout=240)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def wait_for(router, state: str) -> dict:
    deadline = time.monotonic() + 60
    while (c := card(router))["state"] != state:
        assert time.monotonic() < deadline, c
        time.sleep(0.2)
    return c


def test_an_idle_model_sleeps_and_the_next_request_wakes_it(router):
    first = complete(router)
    pid = card(router)["engines"][0]["pid"]
    asleep = wait_for(router, "sleeping")  # TTL 1 s
    assert asleep["loaded"] and asleep["model_ttl_action"] == "sleep"
    assert asleep["engines"][0]["pid"] == pid and asleep["engines"][0]["sleep_level"] == 1
    replica = router.manager.entries["a"].replicas[0]
    engine = httpx.get(replica.url + "/is_sleeping", headers={"Authorization": f"Bearer {replica.api_key}"})
    assert engine.json() == {"is_sleeping": True}
    assert complete(router) == first  # woken by the request, same process
    awake = card(router)
    assert awake["state"] in ("loaded", "sleeping") and awake["engines"][0]["pid"] == pid


def test_sleep_and_wake_by_hand(router):
    router.manager.entries["a"].spec.model_ttl = None  # no TTL sleep racing the explicit one
    first = complete(router)
    r = httpx.post(router.url + "/v1/models/a/sleep", params={"level": 2}, headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["state"] == "sleeping" and r.json()["engines"][0]["sleep_level"] == 2
    r = httpx.post(router.url + "/v1/models/a/wake_up", headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["engines"][0]["sleep_level"] == 0
    assert complete(router) == first
