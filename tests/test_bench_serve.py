"""`pagedesk-bench serve` against a real pagedesk server on 127.0.0.1 (tiny model, small bounded runs):
every request completes with the asked token count, the statistics match numpy over the recorded
timings, the JSON result is written, and bad input is a clear error rather than a crash."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from server_harness import start_server, token_by_token
from engine.bench.serve import main as serve_main
from engine.bench.serve_client import RequestOutcome
from engine.bench.serve_dataset import jsonl_requests, synthetic_requests
from engine.bench.serve_load import ServeLoad, arrival_times, run_benchmark
from engine.bench.serve_metrics import summarize


@pytest.fixture(scope="module")
def server(llama_dir):
    with token_by_token():  # the inter-token latencies below need one chunk per token, however fast the engine
        srv = start_server(llama_dir, num_gpu_blocks_override=256, max_num_seqs=16)
        yield srv
        srv.stop()


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(llama_dir)


def test_poisson_completions_with_token_ids(server):
    requests = synthetic_requests(6, 300, max_model_len=200, prompt_mean=20, fixed_output_len=6)
    seen = []
    summary = run_benchmark(ServeLoad(server.url, request_rate=50.0, seed=1), requests, slo_ttft_ms=1e6,
                            slo_itl_ms=1e6, on_outcome=seen.append)
    assert summary.errors == 0 and summary.completed == 6 == len(seen)
    assert all(o.output_tokens == 6 and len(o.itls) >= 1 for o in seen)
    assert summary.output_tokens == 36 and summary.prompt_tokens == sum(r.prompt_len for r in requests)
    assert summary.goodput == pytest.approx(summary.request_throughput)  # generous SLOs: every request is good


def test_chat_at_fixed_concurrency_with_text_prompts(server, tokenizer):
    requests = synthetic_requests(4, len(tokenizer), max_model_len=200, prompt_mean=12, fixed_output_len=4,
                                  tokenizer=tokenizer)
    assert all(isinstance(r.prompt, str) for r in requests)
    in_flight, peak = [0], [0]

    def stop() -> bool:  # called inside the concurrency gate, before each send
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        return False

    summary = run_benchmark(ServeLoad(server.base_url, endpoint="chat", max_concurrency=1), requests,
                            on_outcome=lambda _: in_flight.__setitem__(0, in_flight[0] - 1), stop=stop)
    assert summary.errors == 0 and summary.completed == 4 and summary.output_tokens == 16
    assert peak[0] == 1 and summary.goodput is None


def test_cli_sweep_writes_json(server, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"hello world number {i}", "output_len": 3})
                                 for i in range(3)) + "\n")
    out = tmp_path / "result.json"
    serve_main(["--base-url", server.base_url, "--dataset-path", str(prompts), "--request-rate", "20,inf",
                "--result-json", str(out), "--no-progress", "--slo-ttft-ms", "0.001"])
    result = json.loads(out.read_text())
    assert [r["request_rate"] for r in result["runs"]] == ["20.0", "inf"]
    for run in result["runs"]:
        assert run["completed"] == 3 and run["errors"] == 0 and run["output_tokens"] == 9
        assert run["goodput"] == 0.0  # nobody meets a 1 µs TTFT
    assert "| rate req/s |" in capsys.readouterr().out


def test_server_errors_are_counted_not_raised(server):
    too_long = synthetic_requests(2, 300, max_model_len=4096, prompt_mean=20, fixed_output_len=1000)
    summary = run_benchmark(ServeLoad(server.url), too_long)  # the server's max_model_len is 256
    assert summary.completed == 0 and summary.errors == 2 and summary.first_errors[0].startswith("HTTP 400")
    assert math.isnan(summary.ttft.p50_ms)


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        jsonl_requests(bad)
    with pytest.raises(SystemExit) as exc:
        serve_main(["--num-prompts", "2", "--no-progress"])  # neither tokenizer nor vocab size
    assert exc.value.code == 2 and "--vocab-size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="request rate"):
        ServeLoad("http://127.0.0.1:1", request_rate=0)
    with pytest.raises(ValueError, match="long prompt range"):
        synthetic_requests(2, 300, max_model_len=100, long_fraction=0.5, long_range=(200, 300))


def test_statistics_are_numpys_over_the_recorded_timings():
    outcomes = [RequestOutcome(10, 4, ttft=0.1 * (i + 1), itls=[0.01 * (i + 1)] * 3, e2e=0.1 * (i + 1) + 0.03 * (i + 1),
                               output_tokens=4) for i in range(5)]
    outcomes.append(RequestOutcome(10, 4, error="HTTP 500: boom"))
    s = summarize(outcomes, duration_s=2.0, slo_ttft_ms=250, slo_itl_ms=1000)
    assert s.completed == 5 and s.errors == 1 and s.request_throughput == 2.5 and s.output_throughput == 10.0
    assert s.ttft.p90_ms == pytest.approx(np.percentile([100, 200, 300, 400, 500], 90))
    assert s.itl.count == 15 and s.itl.mean_ms == pytest.approx(30.0)
    assert s.tpot.p50_ms == pytest.approx(30.0)  # (e2e - ttft) / 3 of the median request
    assert s.goodput == pytest.approx(1.0)  # TTFT 100 and 200 ms meet 250 ms
    offsets = arrival_times(2000, 10.0, seed=3)
    assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0)
    assert np.diff(offsets).mean() == pytest.approx(0.1)  # the offered rate is exactly the rate asked for
    assert np.diff(offsets).std() == pytest.approx(0.1, rel=0.1)  # exponential gaps: std = mean
    assert not arrival_times(3, math.inf, 0).any()


def test_itl_replay_times_every_token_gap(llama_dir):
    from engine.bench.itl import replay
    requests = synthetic_requests(3, 300, max_model_len=128, prompt_mean=40, fixed_output_len=4)
    r = replay(llama_dir, requests, arrival_times(3, 5.0, seed=0), 128, num_gpu_blocks_override=64,
               max_num_batched_tokens=16)
    assert len(r["ttft"]) == 3 and len(r["itl"]) == 3 * 3
    assert (r["itl"] > 0).all() and (r["ttft"] > 0).all() and r["makespan"] >= r["ttft"].max()


def test_served_prompts_are_built_to_token_counts_within_the_context(server):
    """The app's Benchmark prompts: the server's own tokenizer counts them (issue 38: words sized by word count
    ran to 1,539 tokens against a 1,024 context and came back 400). Each prompt is near its drawn length, none
    with its reply passes the context (256 here, long prompts asked for 1k-2k), and every request completes."""
    from engine.bench.serve_prompts import ServedTokenizer, served_requests

    tokenizer = ServedTokenizer(server.base_url, "tiny")
    progress = []
    try:
        requests = served_requests(tokenizer, 8, "completions", prompt_mean=40, long_fraction=0.5,
                                   fixed_output_len=8, on_progress=lambda done, total: progress.append((done, total)))
        chat = served_requests(tokenizer, 3, "chat", prompt_mean=30, fixed_output_len=4)
        counted = [tokenizer.count(r.prompt, "completions") for r in requests]
    finally:
        tokenizer.close()
    assert progress[-1] == (8, 8) and len(progress) == 8
    assert [r.prompt_len for r in requests] == counted  # the lengths are the server's counts
    assert all(r.prompt_len + r.output_len <= 256 for r in requests + chat)
    assert max(r.prompt_len for r in requests) > 150  # the long ones were narrowed to the context, not dropped
    assert len({r.prompt[:40] for r in requests}) == len(requests)  # no shared prefix for the cache to serve
    for endpoint, batch in (("completions", requests), ("chat", chat)):
        summary = run_benchmark(ServeLoad(server.url, endpoint=endpoint), batch)
        assert summary.errors == 0 and summary.completed == len(batch), summary.first_errors
