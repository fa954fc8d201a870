"""`pagedesk-bench reliability`: what abuse costs a real `pagedesk-serve` (issue 15). Eight 3.9 MB prompts at
once (how long a short request waits, the server's peak and held RSS) and fifty engine-state subscribers at
20 Hz (how long a 300-token completion takes beside them). `--repo` runs the server from another checkout,
to compare commits; figures go to BENCHMARKS.md, never into tests.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.bench.random_model import make_random_llama

SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=2048, max_position_embeddings=2048)
HUGE_PROMPT_BYTES = 3_900_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(model: Path, repo: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen([sys.executable, "-m", "engine.entrypoints.serve", "--model", str(model), "--device", "cpu",
                             "--port", str(port), "--served-model-name", "bench", "--num-gpu-blocks-override", "512"],
                            cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("PagedDesk serving"):
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError("the server did not start")


async def _timed_post(client: httpx.AsyncClient, url: str, body: dict) -> float:
    start = time.perf_counter()
    await client.post(url, json=body)
    return time.perf_counter() - start


async def huge_prompts(base: str, pid: int, count: int) -> dict:
    huge = {"prompt": "w5 " * (HUGE_PROMPT_BYTES // 3), "max_tokens": 1}
    short = {"prompt": "w5 w6 w7 w8", "max_tokens": 4}
    before = _rss_mb(pid, "VmRSS")
    async with httpx.AsyncClient(timeout=600) as client:
        huge_tasks = [asyncio.ensure_future(_timed_post(client, base + "/v1/completions", huge)) for _ in range(count)]
        await asyncio.sleep(0.5)  # the huge bodies are in
        short_s = await _timed_post(client, base + "/v1/completions", short)
        huge_s = max(await asyncio.gather(*huge_tasks))
    return {"short_s": short_s, "huge_s": huge_s, "rss_before_mb": before, "rss_peak_mb": _rss_mb(pid, "VmHWM"),
            "rss_after_mb": _rss_mb(pid, "VmRSS")}


async def _subscriber(client: httpx.AsyncClient, url: str, stop: asyncio.Event) -> None:
    async with client.stream("GET", url) as response:
        async for _ in response.aiter_raw():
            if stop.is_set():
                return


async def snapshot_storm(base: str, subscribers: int, tokens: int) -> dict:
    body = {"prompt": "w5 w6 w7", "max_tokens": tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=subscribers + 10)) as client:
        alone = await _timed_post(client, base + "/v1/completions", body)
        stop = asyncio.Event()
        subs = [asyncio.ensure_future(_subscriber(client, base + "/v1/engine/state/stream?hz=20", stop))
                for _ in range(subscribers)]
        await asyncio.sleep(1.0)
        beside = await _timed_post(client, base + "/v1/completions", body)
        stop.set()
        for task in subs:
            task.cancel()
        await asyncio.gather(*subs, return_exceptions=True)
    return {"alone_s": alone, "beside_s": beside}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench reliability", description=__doc__)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2],
                        help="checkout whose engine.entrypoints.serve runs the server (default: this one)")
    parser.add_argument("--huge-prompts", type=int, default=8)
    parser.add_argument("--subscribers", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=300)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_random_llama(Path(tmp) / "llama", **SMALL)
        proc, base = start_server(model, args.repo.resolve())
        try:
            huge = asyncio.run(huge_prompts(base, proc.pid, args.huge_prompts))
            storm = asyncio.run(snapshot_storm(base, args.subscribers, args.tokens))
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"server from {args.repo.resolve()}")
    print("| case | figure |\n|---|---:|")
    print(f"| 4-token request while {args.huge_prompts} × 3.9 MB prompts arrive | {huge['short_s']:.2f} s |")
    print(f"| slowest 3.9 MB prompt answered | {huge['huge_s']:.2f} s |")
    print(f"| server RSS before / peak / after | {huge['rss_before_mb']:.0f} / {huge['rss_peak_mb']:.0f} / "
          f"{huge['rss_after_mb']:.0f} MB |")
    print(f"| {args.tokens}-token completion alone | {storm['alone_s']:.2f} s |")
    print(f"| same beside {args.subscribers} state subscribers at 20 Hz | {storm['beside_s']:.2f} s |")
