"""Issue 34's faults behind the router, for `pagedesk-bench attacks --router`: real router and engine processes.

One router serves `a` (a small random Llama), `corrupt` (its weights file is garbage) and `broken` (its
config.json is not JSON): does it start, and what does /v1/models say of `broken`; how long the first and the
next requests for `corrupt` take (one engine start, then answers at once) and how many engines it started;
a SIGSTOPped engine under a stream (seconds until the stream ends in-band, then until a request is answered
again); an unload storm (streams against `a` while it is unloaded and loaded again: how each stream ended).
A second router serves five copies of the model under `--memory-budget` and is asked to load each in turn
(idle ones are evicted to make room): how many are loaded at the end, and what their engines hold against the
budget. Figures go to BENCHMARKS.md, never into tests.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

STREAM = {"model": "a", "prompt": "w5 w6 w7", "max_tokens": 64, "ignore_eos": True, "stream": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(argv: list[str], repo: Path) -> tuple[subprocess.Popen, str, list[str]]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.entrypoints.serve", *argv, "--device", "cpu",
                             "--port", str(port), "--num-gpu-blocks-override", "512"], cwd=repo,
                            env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 120
    while not any(line.startswith("PagedDesk serving") for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the router did not start: " + "".join(lines[-5:]))
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}", lines


def _card(base: str, name: str) -> dict:
    return next(m for m in httpx.get(base + "/v1/models", timeout=30).json()["data"] if m["id"] == name)


def _stream_end(client: httpx.Client, base: str, body: dict, on_first=None) -> str:
    """How a stream ended: "complete", or the error code (and the start of its message) it ended with."""
    try:
        with client.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = r.read() and r.json().get("error", {})
                return f"{r.status_code} {error.get('code')}: {error.get('message', '')[:40]}"
            last = None
            for line in r.iter_lines():
                if line.startswith("data: ") and line[6:] != "[DONE]":
                    last = json.loads(line[6:])
                    if on_first is not None:
                        on_first()
                        on_first = None
            if last and "error" in last:
                return f"in-band {last['error']['code']}: {last['error']['message'][:40]}"
            return "complete"
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}"


def failed_loads(base: str, lines: list[str]) -> dict:
    times = []
    for _ in range(4):
        start = time.perf_counter()
        status = httpx.post(base + "/v1/completions", json={"model": "corrupt", "prompt": "hi", "max_tokens": 1},
                            timeout=600).status_code
        times.append((time.perf_counter() - start, status))
    starts = sum("corrupt#0: starting engine" in line for line in lines)
    return {"first": times[0], "next_max": max(t for t, _ in times[1:]), "starts": starts,
            "state": _card(base, "corrupt")["state"]}


def stopped_engine(base: str) -> dict:
    httpx.post(base + "/v1/models/a/load", timeout=600).raise_for_status()
    pid = _card(base, "a")["engines"][0]["pid"]
    stopped = {}

    def stop() -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped["at"] = time.perf_counter()

    with httpx.Client(timeout=120) as client:
        end = _stream_end(client, base, {**STREAM, "max_tokens": 1500}, on_first=stop)
    if "at" not in stopped:
        return {"seen_s": float("nan"), "end": f"the stream did not start: {end}", "back_s": float("nan"),
                "status": 0}
    seen_s = time.perf_counter() - stopped["at"]
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    start = time.perf_counter()
    status = httpx.post(base + "/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 1},
                        timeout=600).status_code
    return {"seen_s": seen_s, "end": end, "back_s": time.perf_counter() - start, "status": status}


def unload_storm(base: str, streams: int, rounds: int) -> Counter:
    ends: Counter = Counter()
    stop = threading.Event()

    def client_loop() -> None:
        with httpx.Client(timeout=600) as client:
            while not stop.is_set():
                ends[_stream_end(client, base, STREAM)] += 1

    threads = [threading.Thread(target=client_loop) for _ in range(streams)]
    for t in threads:
        t.start()
    for _ in range(rounds):
        time.sleep(1.0)
        httpx.post(base + "/v1/models/a/unload", timeout=600)
        httpx.post(base + "/v1/models/a/load", timeout=600)
    stop.set()
    for t in threads:
        t.join(600)
    return ends


def engine_pids(base: str) -> list[int]:
    data = httpx.get(base + "/v1/models", timeout=30).json()["data"]
    return [e["pid"] for m in data for e in m["engines"] if e.get("pid")]


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def memory_budget(model: Path, repo: Path, budget_gib: float, copies: int) -> dict:
    argv = [arg for i in range(copies) for arg in ("--model", f"m{i}={model}")]
    proc, base, _ = start_router([*argv, "--memory-budget", str(budget_gib)], repo)
    try:
        for i in range(copies):  # each load evicts idle ones (least recently used) when the budget is full
            httpx.post(base + f"/v1/models/m{i}/load", timeout=600)
        loaded = [m for m in httpx.get(base + "/v1/models", timeout=30).json()["data"] if m["loaded"]]
        held = sum(rss_mib(pid) for pid in engine_pids(base))
        return {"loaded": len(loaded), "held_mib": held, "budget_mib": budget_gib * 1024}
    finally:
        stop_router(proc)


def stop_router(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def router_rows(model: Path, repo: Path, streams: int, rounds: int) -> list[tuple[str, str]]:
    root = model.parent
    corrupt, broken = root / "corrupt", root / "broken"
    shutil.copytree(model, corrupt, dirs_exist_ok=True)
    shutil.copytree(model, broken, dirs_exist_ok=True)
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    (broken / "config.json").write_text("{not json")
    rows = []
    try:
        proc, base, lines = start_router(["--model", f"a={model}", "--model", f"corrupt={corrupt}", "--model",
                                          f"broken={broken}"], repo)
    except RuntimeError as exc:
        return [("router with one broken config.json among three models", f"did not start ({exc})")]
    try:
        rows.append(("router with one broken config.json among three models",
                     f"started; broken is {_card(base, 'broken')['state']}"))
        f = failed_loads(base, lines)
        rows.append(("corrupt weights: first request / the next three (max)",
                     f"{f['first'][0]:.1f} s ({f['first'][1]}) / {f['next_max']:.2f} s; {f['starts']} engine "
                     f"start(s), state {f['state']}"))
        s = stopped_engine(base)
        rows.append(("SIGSTOPped engine under a stream: stream ended / answered again",
                     f"{s['seen_s']:.1f} s ({s['end']}) / {s['back_s']:.1f} s ({s['status']})"))
        ends = unload_storm(base, streams, rounds)
        rows.append((f"{streams} streams through {rounds} unload/load rounds: how they ended",
                     "; ".join(f"{n} {how}" for how, n in ends.most_common())))
    finally:
        stop_router(proc)
    m = memory_budget(model, repo, 1.5, 5)
    rows.append(("5 tiny models loaded in turn under --memory-budget 1.5: loaded at the end, their engines' RSS",
                 f"{m['loaded']} loaded, {m['held_mib']:.0f} MiB held of {m['budget_mib']:.0f} MiB"))
    return rows
