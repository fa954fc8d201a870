"""The router end to end: a real `python -m engine.entrypoints.serve` router process with several models behind it, each
engine a real subprocess, driven through httpx and the real openai SDK.

One router serves every test of this module (engine start-ups are slow on shared cores, so each test reuses
the engines the previous ones loaded): models `a` (llama, long context so a stream can be made long by
construction), `b` (qwen2, a 2-second TTL), `dp` (llama, two replicas), `huge` (a KV cache no machine has) and
`emb` (a tiny Qwen3-Embedding-shaped checkpoint). Outputs are compared with HF transformers'
greedy tokens on the same weights. Every wait is bounded; nothing asserts wall time. The last test sends
SIGTERM to the router and checks that no process is left.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from hf_reference import hf_greedy, make_prompts
from tiny_embedders import hf_embeddings, make_tiny_embedder
from test_cli import free_port
from test_tensor_parallel import descendants

ROOT = Path(__file__).resolve().parents[1]
KEY = "router-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = make_prompts(200)[1:4]  # 3, 15 and 16 tokens
MAX_TOKENS = [8, 12, 10]

B_PIDS: list[int] = []  # b's engine, to see it gone after its TTL
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {"a": tiny_model_dir("llama", max_position_embeddings=4096), "b": tiny_model_dir("qwen2")}


@pytest.fixture(scope="module")
def embedder(tiny_model_dir, tmp_path_factory):
    return make_tiny_embedder(tmp_path_factory.mktemp("router-emb"), "LAST", base=tiny_model_dir("qwen3"))


@pytest.fixture(scope="module")
def references(models):
    return {name: hf_greedy(path, PROMPTS, MAX_TOKENS) for name, path in models.items()}


@pytest.fixture(scope="module")
def router(models, embedder, tmp_path_factory):
    config = tmp_path_factory.mktemp("router") / "models.toml"
    llama = models["a"]
    config.write_text(f"""
[models.dp]
model = "{llama}"
data-parallel-size = 2
max-model-len = 512

[models.b]
model-ttl = 2

[models.huge]
model = "{llama}"
num-gpu-blocks-override = 100000000

[models.emb]
model = "{embedder}"
max-model-len = 128
""")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "engine.entrypoints.serve", "--model", f"a={models['a']}", "--model", f"b={models['b']}",
            "--models-config", str(config), "--device", "cpu", "--port", str(port), "--api-key", KEY,
            "--num-gpu-blocks-override", "300"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 60
    while not any(line.startswith("PagedDesk serving") for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, f"the router did not start: {lines}"
        time.sleep(0.05)
    proc.lines = lines
    proc.url = f"http://127.0.0.1:{port}"
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def card(router, name: str) -> dict:
    data = httpx.get(router.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    return next(m for m in data if m["id"] == name)


def complete(router, model: str, prompt, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}
    return httpx.post(router.url + "/v1/completions", json=body, headers=AUTH, timeout=240)


def sdk(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, timeout=240, max_retries=0)


def pid_alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_models_listed_unloaded_with_their_facts(router):
    data = httpx.get(router.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {"a", "b", "dp", "huge", "emb"} and by_id["b"]["model_ttl"] == 2
    assert not any(m["loaded"] for m in data)
    assert by_id["a"]["max_model_len"] == 4096 and by_id["dp"]["max_model_len"] == 512
    assert by_id["b"]["quantization"] is None and by_id["dp"]["data_parallel_size"] == 2
    assert [m.id for m in sdk(router).models.list().data] == list(by_id)


def test_unknown_model_404_and_key_and_host_checks(router):
    r = complete(router, "nope", "hi", 4)
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "nope" in error["message"]
    with pytest.raises(openai.NotFoundError):
        sdk(router).completions.create(model="nope", prompt="hi", max_tokens=2)
    assert httpx.post(router.url + "/v1/models/a/load", timeout=10).status_code == 401
    assert httpx.post(router.url + "/v1/completions", json={"model": "a"}, timeout=10).status_code == 401
    r = httpx.get(router.url + "/v1/models", headers={**AUTH, "Host": "evil.example"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200


def test_cannot_fit_is_503_naming_the_missing_memory(router):
    r = complete(router, "huge", "hi", 4)
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "insufficient_memory" and "GiB is missing" in error["message"]
    assert "needs" in error["message"] and "KV cache" in error["message"], error["message"]
    assert card(router, "huge")["engines"] == []


def test_jit_load_on_first_request_is_exact(router, references):
    assert not card(router, "a")["loaded"]
    r = complete(router, "a", PROMPTS[0], MAX_TOKENS[0])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == references["a"][0]
    a = card(router, "a")
    assert a["loaded"] and a["state"] == "loaded" and pid_alive(a["engines"][0]["pid"])
    assert a["engines"][0]["devices"] == "cpu" and a["engines"][0]["memory_bytes"] > 0


def test_two_models_concurrent_streams_each_exact(router, references):
    """Both models stream at once through the openai SDK; each output is its own model's greedy output."""
    client = sdk(router)
    results: dict[tuple[str, int], list[int]] = {}

    def stream(model: str, i: int) -> None:
        ids: list[int] = []
        for chunk in client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i],
                                               temperature=0, stream=True, extra_body={"return_token_ids": True}):
            ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
        results[(model, i)] = ids

    threads = [threading.Thread(target=stream, args=(m, i)) for m in ("a", "b") for i in range(len(PROMPTS))]
    B_PIDS.clear()
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    for model in ("a", "b"):
        for i in range(len(PROMPTS)):
            assert results[(model, i)] == references[model][i], (model, i)
    B_PIDS.append(card(router, "b")["engines"][0]["pid"])


def read_until(lines, count: int) -> tuple[list[dict], bool]:
    """Up to `count` content events of an SSE stream; (events, whether [DONE] came)."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line[6:] == "[DONE]":
            return events, True
        events.append(json.loads(line[6:]))
        if len(events) >= count:
            return events, False
    return events, False


def long_stream(client: httpx.Client, router, model: str):
    body = {"model": model, "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 3800,
            "ignore_eos": True, "stream": True}
    if model == "b":
        body["max_tokens"] = 300
    return client.stream("POST", router.url + "/v1/chat/completions", json=body, headers=AUTH)


def test_backend_killed_mid_stream_fails_only_its_own_clients(router, references):
    """a's engine is SIGKILLed while a and b both stream: a's client gets an in-band error then [DONE], b's
    stream goes on; the next request to a restarts its engine."""
    a_pid = card(router, "a")["engines"][0]["pid"]
    with httpx.Client(timeout=240) as client:
        with long_stream(client, router, "a") as a_resp, long_stream(client, router, "b") as b_resp:
            assert a_resp.status_code == b_resp.status_code == 200
            a_lines, b_lines = a_resp.iter_lines(), b_resp.iter_lines()
            assert read_until(a_lines, 2)[0] and read_until(b_lines, 2)[0]
            os.kill(a_pid, signal.SIGKILL)
            rest, done = read_until(a_lines, 10 ** 6)
            assert done and "error" in rest[-1] and rest[-1]["error"]["code"] == "engine_dead", rest[-3:]
            after, b_done = read_until(b_lines, 10 ** 6)  # b streams on to its end
            assert b_done and not any("error" in e for e in after)
            assert after[-1]["choices"][0]["finish_reason"] == "length"
    r = complete(router, "a", PROMPTS[1], MAX_TOKENS[1])  # restarted, after its backoff
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == references["a"][1]
    assert card(router, "a")["engines"][0]["pid"] != a_pid


def test_client_disconnect_aborts_the_backend_request(router):
    with httpx.Client(timeout=240) as client:
        with long_stream(client, router, "a") as resp:
            assert read_until(resp.iter_lines(), 2)[0]
    deadline = time.monotonic() + 60
    running = None
    while time.monotonic() < deadline:
        text = httpx.get(router.url + "/metrics", timeout=10).text
        line = next(x for x in text.splitlines() if x.startswith("pagedesk:num_requests_running")
                    and 'model_name="a"' in x)
        running = float(line.rsplit(" ", 1)[1])
        if running == 0:
            break
        complete(router, "a", "x", 1)  # a step runs, so the engine's stats are fresh
    assert running == 0


def test_ttl_unloads_and_the_next_request_reloads(router, references):
    """b (TTL 2 s) went idle after the tests above: its engine goes away, and the next request loads it again."""
    deadline = time.monotonic() + 60
    while card(router, "b")["loaded"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not card(router, "b")["loaded"] and card(router, "b")["engines"] == []
    assert B_PIDS and not any(pid_alive(p) for p in B_PIDS)
    r = complete(router, "b", PROMPTS[2], MAX_TOKENS[2])
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == references["b"][2]
    assert pid_alive(card(router, "b")["engines"][0]["pid"])


def test_explicit_unload_and_load(router):
    assert httpx.post(router.url + "/v1/models/nope/load", headers=AUTH, timeout=10).status_code == 404
    pid = card(router, "b")["engines"][0]["pid"]
    r = httpx.post(router.url + "/v1/models/b/unload", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["loaded"] is False and r.json()["engines"] == []
    assert not pid_alive(pid)
    r = httpx.post(router.url + "/v1/models/a/load", headers=AUTH, timeout=60)  # already loaded: at once
    assert r.status_code == 200 and r.json()["loaded"] is True


def test_data_parallel_two_replicas_exact_labelled_prefix_aware(router, models):
    """Two replicas: both serve, each output exact; a conversation that shares a prefix stays on the replica
    that served it; /metrics labels each replica with engine="i"."""
    long_a, long_b = make_prompts(200, seed=1)[6], make_prompts(200, seed=2)[6]  # 120 tokens each
    ref = hf_greedy(models["a"], [long_a, long_b, long_a + [7, 8, 9]], [6, 6, 6])
    # Both replicas serve before the first request (the load answers once every start has ended), so the spread
    # below is the balancer's and not which engine happened to be up first.
    loaded = httpx.post(router.url + "/v1/models/dp/load", headers=AUTH, timeout=240)
    assert loaded.status_code == 200, loaded.text
    states = [(e["index"], e["state"], e["error"]) for e in loaded.json()["engines"]]
    assert [s[:2] for s in states] == [(0, "ready"), (1, "ready")], (
        states, [line for line in router.lines if "dp#" in line or "dp:" in line][-20:])
    served = []
    for prompt, expected in ((long_a, ref[0]), (long_b, ref[1]), (long_a + [7, 8, 9], ref[2]), (long_a, ref[0])):
        r = complete(router, "dp", prompt, 6)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected
        served.append(r.headers["x-pagedesk-engine"])
    assert served[0] != served[1], served  # both replicas serve
    assert served[2] == served[3] == served[0], served  # the shared prefix lands where it was served
    engines = card(router, "dp")["engines"]
    assert [e["index"] for e in engines] == [0, 1] and all(pid_alive(e["pid"]) for e in engines)
    if len(os.sched_getaffinity(0)) >= 2:
        assert engines[0]["cpu_cores"] != engines[1]["cpu_cores"]
    text = httpx.get(router.url + "/metrics", timeout=10).text
    for i in ("0", "1"):
        assert any(x.startswith("pagedesk:generation_tokens_total{") and f'engine="{i}"' in x
                   and 'model_name="dp"' in x for x in text.splitlines()), text


def create_response(router, model: str, text: str, **extra) -> httpx.Response:
    body = {"model": model, "input": text, "max_output_tokens": 3, "temperature": 0, **extra}
    return httpx.post(router.url + "/v1/responses", json=body, headers=AUTH, timeout=240)


def test_responses_by_id_follow_the_engine_that_made_them(router):
    """GET/DELETE /v1/responses/{id} and previous_response_id reach the replica that created the id (read from the
    create reply, JSON or stream), across models and the two replicas of dp; other models may not chain it."""
    client = sdk(router)
    made = {}
    for model, text in (("a", "Hello"), ("dp", "Paris is"), ("dp", "The quick brown fox")):
        r = create_response(router, model, text)
        assert r.status_code == 200, r.text
        made[r.json()["id"]] = r.headers["x-pagedesk-engine"]
    with client.responses.stream(model="dp", input="Continuous batching", max_output_tokens=3) as stream:
        streamed = [e.response for e in stream if e.type == "response.incomplete"][0]  # cut at max_output_tokens
    made[streamed.id] = None  # which replica streamed it: the retrieval below must find it either way
    print("responses made by", made)
    for response_id, engine in made.items():
        got = httpx.get(f"{router.url}/v1/responses/{response_id}", headers=AUTH, timeout=60)
        assert got.status_code == 200 and got.json()["id"] == response_id, got.text
        assert engine is None or got.headers["x-pagedesk-engine"] == engine
    first_dp = next(i for i, e in made.items() if e and e.startswith("dp#"))
    chained = create_response(router, "dp", "and then?", previous_response_id=first_dp)
    assert chained.status_code == 200, chained.text
    assert chained.headers["x-pagedesk-engine"] == made[first_dp]
    assert chained.json()["previous_response_id"] == first_dp
    with pytest.raises(openai.BadRequestError, match="created by model `dp`"):
        client.responses.create(model="a", input="x", previous_response_id=first_dp, max_output_tokens=2)
    assert client.responses.retrieve(streamed.id).id == streamed.id
    client.responses.delete(streamed.id)
    with pytest.raises(openai.NotFoundError, match="is known to this router"):
        client.responses.retrieve(streamed.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_unknown")


def test_embeddings_routed_by_model(router, embedder):
    client = sdk(router)
    r = client.embeddings.create(model="emb", input=["Paris", "numbers 0 1 2"])
    assert [d.index for d in r.data] == [0, 1] and r.model == "emb"
    tokenizer_ids = [list(map(int, ids)) for ids in (
        httpx.post(router.url + "/tokenize", json={"model": "emb", "prompt": t}, headers=AUTH, timeout=60)
        .json()["tokens"] for t in ("Paris", "numbers 0 1 2"))]
    for d, expected in zip(r.data, hf_embeddings(embedder, tokenizer_ids)):
        assert max(abs(x - y) for x, y in zip(d.embedding, expected)) < 1e-5
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        client.embeddings.create(model="a", input="hello")


def test_sigterm_to_the_router_leaves_no_process(router):
    pids = descendants(router.pid)
    assert len(pids) >= 2  # the engines of a and dp at least
    router.send_signal(signal.SIGTERM)
    assert router.wait(60) == 0
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)]
