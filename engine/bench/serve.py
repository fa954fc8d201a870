"""`pagedesk-bench serve`: online serving benchmark against any OpenAI-compatible endpoint (ours or another).

Poisson arrivals at a rate, a fixed concurrency, or a sweep of rates (`--request-rate 1,2,4`); synthetic
ShareGPT-like lengths (optionally a share of long prompts; with `--tokenizer served`, text built to those
token counts by the endpoint's own /tokenize and capped by its context) or a JSONL of prompts; completions or chat;
always streaming. Prints a markdown table per run (TTFT/TPOT/ITL/E2E percentiles, throughput, goodput)
and writes every figure to `--result-json`. Torch-free; never asserted in tests.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import httpx

from engine.bench.serve_dataset import jsonl_requests, synthetic_requests, write_jsonl
from engine.bench.serve_load import ServeLoad, run_benchmark
from engine.bench.serve_metrics import ServeSummary
from engine.bench.serve_prompts import ServedTokenizer, served_requests

SERVED = "served"  # --tokenizer served: the endpoint counts the tokens


def parse_rates(text: str) -> list[float]:
    try:
        rates = [math.inf if part.strip() == "inf" else float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--request-rate takes numbers or inf, comma-separated; got {text!r}")
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0, got {text!r}")
    return rates


def parse_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH token counts, got {text!r}")
    return low, high


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedesk-bench serve", description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", help="model name sent in requests (default: the first one /v1/models lists)")
    p.add_argument("--api-key")
    p.add_argument("--tokenizer", help="tokenizer folder: synthetic prompts become text (needed for chat); "
                   f"{SERVED!r}: the endpoint's own tokenizer (/tokenize, /detokenize) builds them to token counts")
    p.add_argument("--dataset-path", type=Path, help="JSONL of {\"prompt\": ..., \"output_len\": ...} rows")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=parse_rates, default=[math.inf],
                   help="requests/s of Poisson arrivals; a comma list sweeps rates; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight (fixed-concurrency runs)")
    p.add_argument("--vocab-size", type=int, help="token ids of synthetic prompts are drawn below this "
                   "(default: the tokenizer's size)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + output of synthetic requests fit this")
    p.add_argument("--prompt-mean", type=float, default=160, help="mean synthetic prompt tokens (log-normal)")
    p.add_argument("--output-mean", type=float, default=300, help="mean synthetic output tokens (log-normal)")
    p.add_argument("--output-len", type=int, help="every request asks for exactly this many tokens")
    p.add_argument("--long-prompt-fraction", type=float, default=0.0, help="share of requests with a long prompt")
    p.add_argument("--long-prompt-range", type=parse_range, default=(1024, 2048), help="LOW:HIGH tokens")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: exactly output_len tokens each, via ignore_eos)")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-itl-ms", type=float, help="SLO on each request's mean inter-token latency (TPOT)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--result-json", type=Path, help="write the configuration and every figure here")
    p.add_argument("--save-dataset", type=Path, help="also write the requests as JSONL (prompt, output_len, "
                   "output_tokens) so another client, e.g. `vllm bench serve --dataset-name custom`, replays "
                   "the same load")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def load_requests(args, tokenizer):
    if args.tokenizer == SERVED and args.dataset_path is None:
        served = ServedTokenizer(args.base_url, args.model, args.api_key)
        try:
            return served_requests(served, args.num_prompts, args.endpoint, args.seed, args.prompt_mean,
                                   args.output_mean, args.long_prompt_fraction, args.long_prompt_range,
                                   args.output_len)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"cannot build prompts with the served tokenizer at {args.base_url}: {exc}") from None
    if args.dataset_path is not None:
        return jsonl_requests(args.dataset_path, args.num_prompts, args.output_len or 128, tokenizer)
    vocab = args.vocab_size or (len(tokenizer) if tokenizer is not None else None)
    if vocab is None:
        raise ValueError("synthetic prompts need --tokenizer or --vocab-size (token ids are drawn below it)")
    return synthetic_requests(args.num_prompts, vocab, args.max_model_len, args.seed, args.prompt_mean,
                              args.output_mean, args.long_prompt_fraction, args.long_prompt_range,
                              args.output_len, tokenizer)


def table(runs: list[tuple[float, ServeSummary]]) -> str:
    head = ("| rate req/s | done | err | req/s | out tok/s | goodput | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms "
            "| ITL p99/p50 | TPOT p50/p99 ms | E2E p50/p99 ms |\n|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|")
    rows = [head]
    for rate, s in runs:
        goodput = "-" if s.goodput is None else f"{s.goodput:.2f}"
        rows.append(f"| {rate:g} | {s.completed} | {s.errors} | {s.request_throughput:.2f} | "
                    f"{s.output_throughput:.1f} | {goodput} | {s.ttft.p50_ms:.0f} / {s.ttft.p90_ms:.0f} / "
                    f"{s.ttft.p99_ms:.0f} | {s.itl.p50_ms:.1f} / {s.itl.p90_ms:.1f} / {s.itl.p99_ms:.1f} | "
                    f"{s.itl.p99_ms / s.itl.p50_ms:.1f}× | {s.tpot.p50_ms:.1f} / {s.tpot.p99_ms:.1f} | "
                    f"{s.e2e.p50_ms:.0f} / {s.e2e.p99_ms:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        tokenizer = None
        if args.tokenizer and args.tokenizer != SERVED:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        requests = load_requests(args, tokenizer)
        if args.save_dataset:
            write_jsonl(args.save_dataset, requests)
        runs = []
        for rate in args.request_rate:
            load = ServeLoad(args.base_url, args.model, args.endpoint, rate, args.max_concurrency, args.ignore_eos,
                             args.seed, args.api_key, args.timeout)
            runs.append((rate, _run_one(load, requests, args)))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"pagedesk-bench serve: {exc}", file=sys.stderr)
        raise SystemExit(2)
    print(f"\n{len(requests)} requests, {sum(r.prompt_len for r in requests)} prompt tokens, endpoint "
          f"{args.endpoint}, max concurrency {args.max_concurrency or 'unbounded'}, {args.base_url}\n")
    print(table(runs))
    for rate, s in runs:
        for error in s.first_errors:
            print(f"rate {rate:g}: error: {error}", file=sys.stderr)
    if args.result_json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        config["request_rate"] = [str(r) for r in args.request_rate]
        result = {"time": time.time(), "config": config,
                  "runs": [{"request_rate": str(rate), **s.to_dict()} for rate, s in runs]}
        args.result_json.write_text(json.dumps(result, indent=2))


def _run_one(load: ServeLoad, requests, args) -> ServeSummary:
    bar = None
    if args.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc=f"rate {load.request_rate:g}", unit="req")
    try:
        return run_benchmark(load, requests, args.slo_ttft_ms, args.slo_itl_ms,
                             on_outcome=(lambda _: bar.update(1)) if bar else None)
    finally:
        if bar is not None:
            bar.close()
