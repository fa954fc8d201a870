"""Per-step expert load (engine/layers/fused_moe/expert_load.py) on a tiny Qwen3-MoE: the counts equal what HF
transformers' own router picks for the same tokens (each top-k choice once, so a layer sums to tokens x top_k),
padding rows of the decode-graph and piecewise-graph paths (run on CPU) do not count, `/metrics` carries the cumulative family and the
engine-state document the counts of each interval; on fake CUDA tensors the counting makes no host copy.
"""
from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.core.outputs import BlockPoolSnapshot, EngineStats
from engine.worker.graphs.piecewise import PiecewiseGraphs
from graph_tape import TapeGraphBackend
from engine.entrypoints.openai.engine_state import ExpertLoadInterval, RawState, build_state
from hf_reference import make_prompts
from server_harness import MODEL_NAME, start_server
from test_fake_cuda import CUDA, Recorder, fake_cuda  # noqa: F401 (the fixture)

PICKS, MAX_TOKENS = [0, 1, 2], [3, 4, 3]  # prompts of 1, 3 and 15 tokens
BUDGET = 32  # max_num_batched_tokens: piecewise buckets of 16 and 32 tokens
TOP_K, NUM_EXPERTS = 2, 8  # tests/tiny_models.py MOE_ARCHS["qwen3_moe"]
METRIC = re.compile(r'^pagedesk:moe_expert_tokens_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)


@pytest.fixture(scope="module")
def moe(tiny_model_dir):
    path = tiny_model_dir("qwen3_moe")
    return path, [make_prompts(400)[i] for i in PICKS], AutoModelForCausalLM.from_pretrained(path).eval()


def reference_counts(hf, sequences: list[list[int]]) -> list[list[int]]:
    """Per MoE layer and expert, HF's router choices over every token each sequence fed the model."""
    counts = torch.zeros(2, NUM_EXPERTS, dtype=torch.long)
    for ids in sequences:
        with torch.no_grad():
            logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
        for layer, lg in enumerate(logits):
            counts[layer] += torch.bincount(lg.topk(TOP_K, dim=-1).indices.flatten(), minlength=NUM_EXPERTS)
    return counts.tolist()


def fed(prompt: list[int], generated: list[int]) -> list[int]:
    return prompt + generated[:-1]  # the last sampled token is never fed back


def test_counts_equal_the_reference_router_padding_rows_excluded(moe):
    path, prompts, hf = moe
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=BUDGET)
    runner = llm.engine.runner
    runner.plan_decode_graphs(max_batch=4, capture=False)  # 3 decoding sequences run as a padded batch of 4
    padded = []
    run = runner.graphs.run
    runner.graphs.run = lambda inputs, tables: padded.append(len(inputs.seq_lens) == 3) or run(inputs, tables)
    assert llm.engine.get_stats().expert_load["tokens"] == [[0] * NUM_EXPERTS] * 2  # loading counted nothing
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert any(padded)
    stats = llm.engine.get_stats()
    load = stats.expert_load
    assert load["num_experts"] == NUM_EXPERTS and load["layers"] == [0, 1]
    assert load["tokens"] == reference_counts(hf, [fed(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)])
    num_fed = stats.prompt_tokens_total + stats.generation_tokens_total - len(prompts)
    assert [sum(row) for row in load["tokens"]] == [num_fed * TOP_K] * 2

    # Piecewise graphs (the CPU tape backend, strict: a host sync in a piece fails the capture): a 17-token
    # prompt replays the 32-token bucket; its 15 padding rows, and the capture's own forwards, count nothing.
    graphs = PiecewiseGraphs(runner.model, BUDGET, runner.device, TapeGraphBackend(), strict=True,
                             num_kv_groups=len(runner.kv_layout.groups))
    graphs.capture()
    runner.piecewise = graphs
    before = np.array(llm.engine.get_stats().expert_load["tokens"])
    assert before.tolist() == load["tokens"]
    prompt = make_prompts(400)[4]
    out = llm.generate([prompt], [SamplingParams(temperature=0, max_tokens=2)], use_tqdm=False)[0]
    assert graphs.replayed_tokens >= len(prompt)
    delta = np.array(llm.engine.get_stats().expert_load["tokens"]) - before
    assert delta.tolist() == reference_counts(hf, [fed(prompt, out.outputs[0].token_ids)])


def test_metrics_and_engine_state_carry_the_load(moe):
    path, prompts, hf = moe
    server = start_server(path)
    try:
        def state() -> dict:
            r = httpx.get(server.base_url + "/engine/state", timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["expert_load"]

        assert state() == {"num_experts": NUM_EXPERTS, "layers": [0, 1], "tokens": [[0] * NUM_EXPERTS] * 2}
        r = httpx.post(server.base_url + "/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": prompts[1], "max_tokens": 4, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        expected = reference_counts(hf, [fed(prompts[1], r.json()["choices"][0]["token_ids"])])
        interval = state()
        print("engine-state expert_load:", interval)
        assert interval["tokens"] == expected  # the interval that held the request
        assert state()["tokens"] == [[0] * NUM_EXPERTS] * 2  # nothing ran since the previous document
        text = httpx.get(server.url + "/metrics", timeout=60).text
        series = {}
        for m in METRIC.finditer(text):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
            assert labels["model_name"] == MODEL_NAME
            series[int(labels["layer"]), int(labels["expert"])] = float(m["value"])
        assert re.search(r"^# TYPE pagedesk:moe_expert_tokens(_total)? counter$", text, re.M)
        assert series == {(layer, e): float(expected[layer][e]) for layer in (0, 1) for e in range(NUM_EXPERTS)}
    finally:
        server.stop()


def test_interval_counts_and_dense_models():
    interval = ExpertLoadInterval()
    first = {"num_experts": 2, "layers": [1, 3], "tokens": [[4, 2], [1, 5]]}
    assert interval.since_last(first) == first  # the first document counts since start
    later = {"num_experts": 2, "layers": [1, 3], "tokens": [[6, 2], [4, 9]]}
    assert interval.since_last(later) == {"num_experts": 2, "layers": [1, 3], "tokens": [[2, 0], [3, 4]]}
    snapshot = BlockPoolSnapshot(np.zeros(4, np.uint8), np.zeros(4, np.int32), np.full(4, -1, np.int32), [])
    dense = build_state(RawState(snapshot, EngineStats(block_size=16), {}, "cpu"), "m", (0.0, 0.0), interval)
    assert "expert_load" not in dense
    moe = build_state(RawState(snapshot, EngineStats(block_size=16, expert_load=later), {}, "cpu"), "m", (0.0, 0.0))
    assert moe["expert_load"] == later  # without an interval tracker: since start


@pytest.mark.fake_cuda
def test_counting_makes_no_host_copy_on_cuda(fake_cuda, monkeypatch):  # noqa: F811
    import kernels.triton_moe as tm
    from engine.layers.fused_moe import ExpertLoad, RouterSpec, SparseMoeBlock
    monkeypatch.setattr(tm, "fused_moe_kernel", Recorder("fused_moe", fake_cuda))
    with torch.device(CUDA):
        blocks = [SparseMoeBlock(RouterSpec(NUM_EXPERTS, TOP_K, renormalize=True), 32, 16,
                                 prefix=f"model.layers.{i}.mlp") for i in (1, 2)]
    load = ExpertLoad(blocks, CUDA)
    assert load.layers == [1, 2] and load.counts.device == CUDA
    load.begin_step(3)
    x = torch.randn(4, 32, device=CUDA)  # a padded batch: 3 real rows
    for block in blocks:
        assert block(x).device == CUDA
    assert fake_cuda.launches.count("fused_moe") == 4 and fake_cuda.host_copies == 0  # nothing read in the step
    assert len(load.totals()["tokens"]) == 2 and fake_cuda.host_copies == 1  # read once, when stats are taken
