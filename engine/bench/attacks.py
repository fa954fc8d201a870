"""`pagedesk-bench attacks`: issues 27 and 34's attacks on a real `pagedesk-serve`, bounded, with what they cost a
bystander.

Attacks in turn against one server (a small random Llama): the requests that used to kill the engine
(is it still serving after each?), eight concurrent expensive json_schema requests (bystander completion and
json_object latency, /v1/engine/state time), fifty streaming clients that never read (server RSS over the
window, bystander completion latency), a flood of slowloris connections past the default 1024 open files
(/health time), one and four clients sending 4 MiB bodies of 250k tiny keys (bystander p50/max), stored
Responses with 3.9 MB of tools each (server RSS before/after), and SIGTERM with streams in flight (tracebacks
in the log). `--router` adds issue 34's faults behind the router (engine/bench/router_attacks.py). `--repo`
runs the server from another checkout to compare commits; figures go to BENCHMARKS.md, never into tests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import signal
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from engine.bench.random_model import make_random_llama
from engine.bench.reliability import SMALL, _rss_mb, start_server

CHAT = {"prompt": "w5 w6 w7", "max_tokens": 8}  # a completion: the random model has no chat template
KILLERS = [("/v1/completions", {**CHAT, "top_k": 2**64}),
           ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "top_k": 2**63}),
           ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stop_token_ids": [2**64]}),
           ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, "n": 2,
                                "length_penalty": 1e308}),
           ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, "n": 2,
                                "length_penalty": -1e308})]


def _expensive_schemas(count: int) -> list[dict]:
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"allOf": [deep, {"type": "string"}]}
    kinds = [{"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}},
             {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}}, "required": [f"k{i}"]}
                        for i in range(500)]}, deep]
    schemas = []
    for i in range(count):
        schema = json.loads(json.dumps(kinds[i % len(kinds)]))
        schema["description"] = f"attack {i}"  # distinct, so none is a cache hit
        schemas.append(schema)
    return schemas


def _timed(client: httpx.Client, method: str, url: str, **kwargs) -> tuple[float, int]:
    start = time.perf_counter()
    try:
        status = client.request(method, url, **kwargs).status_code
    except httpx.HTTPError:
        status = 0
    return time.perf_counter() - start, status


def killers(base: str) -> str:
    served = []
    with httpx.Client(timeout=60) as client:
        for path, body in KILLERS:
            client.post(base + path, json=body)
            served.append(client.get(base + "/health").status_code == 200)
    return f"{sum(served)} of {len(served)}"


STATUSES: list[int] = []  # every bystander answer's status, so a fast error never passes for a fast answer


def _bystander(base: str, count: int, body: dict) -> list[float]:
    with httpx.Client(timeout=120) as client:
        timed = [_timed(client, "POST", base + "/v1/completions", json=body) for _ in range(count)]
    STATUSES.extend(status for _, status in timed)
    return [t for t, _ in timed]


def _answered(count: int) -> str:
    last = STATUSES[-count:]
    return f"{sum(s == 200 for s in last)}/{len(last)} answered 200"


def grammar_storm(base: str, count: int) -> dict:
    quiet = _bystander(base, 5, CHAT)
    quiet_ok = _answered(5)
    senders = [threading.Thread(target=_bystander, args=(base, 1, {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": s}}})) for s in _expensive_schemas(count)]
    for t in senders:
        t.start()
    time.sleep(0.3)
    chat = _bystander(base, 5, CHAT)
    chat_ok = _answered(5)
    json_object = _bystander(base, 1, {**CHAT, "response_format": {"type": "json_object"}})
    json_ok = _answered(1)
    with httpx.Client(timeout=120) as client:
        state_s, _ = _timed(client, "GET", base + "/v1/engine/state")
    for t in senders:
        t.join(300)
    return {"quiet_p50": statistics.median(quiet), "p50": statistics.median(chat), "max": max(chat),
            "json_object": json_object[0], "state": state_s, "ok": (quiet_ok, chat_ok, json_ok)}


def _stalled_stream(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect((host, int(port)))
    body = json.dumps({"prompt": "w5 w6", "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def stalled_readers(base: str, pid: int, count: int, window_s: float) -> dict:
    before = _rss_mb(pid, "VmRSS")
    socks = [_stalled_stream(base) for _ in range(count)]
    time.sleep(window_s / 2)
    middle = _rss_mb(pid, "VmRSS")
    chat = _bystander(base, 5, CHAT)
    ok = _answered(5)
    time.sleep(window_s / 2)
    after = _rss_mb(pid, "VmRSS")
    for s in socks:
        s.close()
    return {"rss": (before, middle, after), "p50": statistics.median(chat), "max": max(chat), "ok": ok}


def connection_flood(base: str, count: int) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 256)), hard))
    host, port = base.removeprefix("http://").split(":")
    socks = []
    for _ in range(count):
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(s)
        except OSError:
            break
    with httpx.Client(timeout=120) as client:
        health_s, status = _timed(client, "GET", base + "/health")
    for s in socks:
        s.close()
    return {"opened": len(socks), "health_s": health_s, "status": status}


# /v1/responses runs on the chat path: the random model gets a plain template for it.
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def large_bodies(base: str, attackers: int, window_s: float) -> dict:
    """Bystander completions while `attackers` clients keep sending 4 MiB bodies of 250k tiny keys."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1, "metadata": {f"k{i}": 1 for i in range(250_000)}}).encode()
    quiet = statistics.median(_bystander(base, 5, CHAT))
    stop, statuses = threading.Event(), []

    def attack() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                statuses.append(_timed(client, "POST", base + "/v1/completions", content=body,
                                       headers={"content-type": "application/json"})[1])

    threads = [threading.Thread(target=attack) for _ in range(attackers)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    deadline, chat = time.monotonic() + window_s, []
    while time.monotonic() < deadline:
        chat += _bystander(base, 1, CHAT)
    ok = _answered(len(chat))
    stop.set()
    for t in threads:
        t.join(120)
    refused = f"{sum(s == 400 for s in statuses)}/{len(statuses)} refused 400"
    return {"quiet_p50": quiet, "p50": statistics.median(chat), "max": max(chat), "ok": ok, "refused": refused}


def stored_responses(base: str, pid: int, count: int) -> dict:
    """Server RSS before and after `count` stored Responses whose tools hold 3.9 MB (tool_choice none: the
    tools never reach the prompt, only the stored response)."""
    tools = [{"type": "function", "name": f"t{i}", "description": "x" * 39_000, "parameters": {"type": "object"}}
             for i in range(100)]
    before = _rss_mb(pid, "VmRSS")
    with httpx.Client(timeout=120) as client:
        statuses = [client.post(base + "/v1/responses", json={"input": "hi", "max_output_tokens": 1, "tools": tools,
                                                              "tool_choice": "none"}).status_code
                    for _ in range(count)]
    return {"rss": (before, _rss_mb(pid, "VmRSS")), "ok": f"{sum(s == 200 for s in statuses)}/{count} stored"}


def sigterm(proc, base: str) -> str:
    streams = [_stalled_stream(base) for _ in range(3)]
    reading = threading.Thread(target=_bystander, args=(base, 1, {**CHAT, "max_tokens": 1500, "ignore_eos": True,
                                                                  "stream": True}))
    reading.start()
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    for s in streams:
        s.close()
    reading.join(30)
    return "yes" if "Traceback" in output or "CancelledError" in output else "no"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench attacks", description=__doc__)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2],
                        help="checkout whose engine.entrypoints.serve runs the server (default: this one)")
    parser.add_argument("--schemas", type=int, default=8)
    parser.add_argument("--stalled", type=int, default=50)
    parser.add_argument("--window", type=float, default=30.0, help="seconds the stalled readers are watched")
    parser.add_argument("--connections", type=int, default=1100)
    parser.add_argument("--body-window", type=float, default=10.0, help="seconds the large-body attackers run")
    parser.add_argument("--stored", type=int, default=40, help="Responses stored with 3.9 MB of tools each")
    parser.add_argument("--router", action="store_true", help="also issue 34's faults behind the router")
    parser.add_argument("--storm-streams", type=int, default=8)
    parser.add_argument("--storm-rounds", type=int, default=6)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_random_llama(Path(tmp) / "llama", **SMALL)
        (model / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
        proc, base = start_server(model, args.repo.resolve())
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
        try:
            rows.append(("still serving after each reported killer", killers(base)))
            if proc.poll() is None and httpx.get(base + "/health").status_code != 200:
                proc.terminate()
                proc.wait(30)
                proc, base = start_server(model, args.repo.resolve())
                threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            g = grammar_storm(base, args.schemas)
            rows += [("bystander completion p50, quiet", f"{g['quiet_p50']:.3f} s ({g['ok'][0]})"),
                     (f"bystander completion p50 / max beside {args.schemas} expensive schemas",
                      f"{g['p50']:.3f} / {g['max']:.3f} s ({g['ok'][1]})"),
                     ("json_object request during the schemas", f"{g['json_object']:.2f} s ({g['ok'][2]})"),
                     ("/v1/engine/state during the schemas", f"{g['state']:.2f} s")]
            s = stalled_readers(base, proc.pid, args.stalled, args.window)
            rows += [(f"server RSS with {args.stalled} never-reading streams: start / {args.window / 2:.0f} s / "
                      f"{args.window:.0f} s", " / ".join(f"{v:.0f}" for v in s["rss"]) + " MB"),
                     ("bystander completion p50 / max beside them", f"{s['p50']:.3f} / {s['max']:.3f} s ({s['ok']})")]
            c = connection_flood(base, args.connections)
            rows.append((f"/health beside {c['opened']} slowloris connections", f"{c['health_s']:.2f} s "
                         f"({c['status'] or 'no answer'})"))
            for attackers in (1, 4):
                b = large_bodies(base, attackers, args.body_window)
                rows.append((f"bystander completion p50 quiet, then p50 / max beside {attackers} client(s) sending "
                             "4 MiB bodies of 250k keys", f"{b['quiet_p50']:.3f}, then {b['p50']:.3f} / {b['max']:.3f} s "
                             f"({b['ok']}; attack {b['refused']})"))
            r = stored_responses(base, proc.pid, args.stored)
            rows.append((f"server RSS before / after {args.stored} stored Responses with 3.9 MB of tools each",
                         " / ".join(f"{v:.0f}" for v in r["rss"]) + f" MB ({r['ok']})"))
        finally:
            pass
        proc2, base2 = start_server(model, args.repo.resolve())
        rows.append(("traceback in the log after SIGTERM with streams in flight", sigterm(proc2, base2)))
        proc.terminate()
        try:
            proc.wait(30)
        except Exception:  # noqa: BLE001
            proc.kill()
        if args.router:
            from engine.bench.router_attacks import router_rows
            rows += router_rows(model, args.repo.resolve(), args.storm_streams, args.storm_rounds)
    print(f"server from {args.repo.resolve()}")
    print("| attack | figure |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
