"""Sleep mode (`sleep(level)`, `wake_up`, vLLM's levels) on CPU: greedy ids are identical before and after a sleep
at either level (dense, hybrid, sliding-window and MoE models, quantized checkpoints reloaded at level 2, a drafting
engine, tensor parallel, and with the CPU-RAM tier, whose blocks survive the sleep and serve
the prefix after it); a request that arrives while the engine sleeps waits and runs after the wake; the KV cache's
memory leaves the process at sleep (RSS); on a card the weights and the KV cache are counted as freed and the
weights come back to the device (fake CUDA).
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

from engine import LLM, SamplingParams
from test_fake_cuda import CUDA, fake_cuda, fake_runner, tiny_weights  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5 + (7 * i) % 300 for i in range(40)], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3]


def greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch,level", [("llama", 1), ("llama", 2), ("qwen3_5", 1), ("qwen3_5", 2), ("gemma3", 2),
                                        ("qwen3_moe", 2), ("gpt_oss", 2)])
def test_greedy_ids_identical_after_sleep_and_wake(tiny_model_dir, arch, level):
    llm = LLM(str(tiny_model_dir(arch)), device="cpu", num_gpu_blocks_override=32, max_num_seqs=2)
    before = greedy(llm)
    freed = llm.sleep(level)
    engine = llm.engine
    assert engine.is_sleeping and engine.get_stats().sleep_level == level
    assert engine.runner.kv_cache is None and freed["kv_cache_bytes"] > 0
    assert (freed["weights_bytes"] > 0) == (level == 2)  # on CPU level 1 leaves the weights where they are
    if level == 2:
        assert all(p.numel() == 0 for p in engine.runner.model.parameters())
    llm.wake_up()
    assert not engine.is_sleeping and engine.kv.pool.num_free_blocks == 32
    assert greedy(llm) == before


def test_a_request_that_arrives_asleep_waits_for_the_wake(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", num_gpu_blocks_override=32, max_num_seqs=2)
    expected = greedy(llm, PROMPTS[:1])
    engine = llm.engine
    engine.add_request("running", PROMPTS[1], GREEDY)
    engine.step()  # admitted and running: sleep preempts it, it recomputes after the wake
    llm.sleep(1)
    engine.add_request("asleep", PROMPTS[0], GREEDY)
    assert all(engine.step() == [] for _ in range(3)) and engine.has_unfinished_requests()
    llm.wake_up()
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert done["asleep"].outputs[0].token_ids == expected[0] and len(done["running"].outputs[0].token_ids) == 8


def test_the_tier_keeps_the_prefix_across_a_sleep(tiny_model_dir):
    """The device pool is dropped at sleep: the context's blocks are stored to the CPU-RAM tier first, so the turn
    after the wake loads them instead of recomputing (same ids as an engine that never slept)."""
    path = str(tiny_model_dir("llama"))
    args = dict(device="cpu", num_gpu_blocks_override=16, max_num_seqs=2, max_num_batched_tokens=32)
    context = [5 + (11 * i) % 390 for i in range(100)]
    expected = greedy(LLM(path, **args), [context + [1, 2, 3]])
    llm = LLM(path, kv_offloading_size=0.01, **args)
    greedy(llm, [context + [7, 8, 9]])
    llm.sleep(1)
    llm.wake_up()
    out = llm.generate([context + [1, 2, 3]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[0] and out.num_cached_tokens == 96
    assert llm.engine.kv.offload.stats.blocks_loaded == 6


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS read from /proc")
def test_the_kv_cache_leaves_the_process_at_sleep(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", num_gpu_blocks_override=8192, max_num_seqs=2)
    kv_bytes = llm.engine.runner.kv_cache_bytes()
    assert kv_bytes >= 48 * 2**20  # large enough to see in RSS (allocated zeroed, so resident)
    greedy(llm, PROMPTS[:1])
    gc.collect()
    awake = rss_bytes()
    freed = llm.sleep(1)
    gc.collect()
    asleep = rss_bytes()
    print(f"RSS {awake / 2**20:.0f} MiB awake, {asleep / 2**20:.0f} MiB asleep; KV cache {kv_bytes / 2**20:.0f} MiB")
    assert freed["kv_cache_bytes"] == kv_bytes and awake - asleep >= 0.8 * kv_bytes
    llm.wake_up()
    assert rss_bytes() - asleep >= 0.8 * kv_bytes


@pytest.mark.fake_cuda
@pytest.mark.parametrize("level", [1, 2])
def test_a_card_frees_the_weights_and_the_kv_cache(tiny_weights, fake_cuda, monkeypatch, level):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    runner = fake_runner(monkeypatch, fake_cuda, tiny_weights, torch.float16)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv = runner.kv_cache_bytes()
    freed = runner.sleep(level)
    assert freed == {"kv_cache_bytes": kv, "weights_bytes": weights} and runner.kv_cache is None
    assert all(p.numel() == 0 for p in runner.model.parameters())  # the device copies are gone
    hosts = [t.host for t in runner.sleeping.params]
    if level == 1:  # in host RAM, values kept
        assert {h.device.type for h in hosts} == {"cpu"} and sum(h.numel() * h.element_size() for h in hosts) == weights
    else:  # dropped: the checkpoint has them
        assert hosts == [None] * len(hosts)
    assert all(t.host.device.type == "cpu" for t in runner.sleeping.buffers)
    runner.wake_up()
    assert {p.device for p in runner.model.parameters()} == {CUDA} and runner.kv_cache.device == CUDA
    assert sum(p.numel() * p.element_size() for p in runner.model.parameters()) == weights
    assert runner.kv_cache_bytes() == kv


def test_tensor_parallel_ranks_sleep_and_wake_together(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    expected = greedy(LLM(path, device="cpu", num_gpu_blocks_override=32, max_num_seqs=2))
    llm = LLM(path, tensor_parallel_size=2, device="cpu", num_gpu_blocks_override=32, max_num_seqs=2)
    try:
        assert llm.sleep(2)["weights_bytes"] > 0  # rank 0's shard
        llm.wake_up()
        assert greedy(llm) == expected
    finally:
        llm.engine.shutdown()


def test_the_server_sleeps_and_wakes_and_holds_requests_meanwhile(tiny_model_dir):
    import threading
    import time

    import httpx

    from server_harness import MODEL_NAME, start_server
    srv = start_server(tiny_model_dir("llama"), num_gpu_blocks_override=32, max_num_seqs=2)
    try:
        body = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, ignore_eos=True)
        awake = httpx.post(srv.base_url + "/completions", json=body).json()["choices"][0]["text"]
        slept = httpx.post(srv.url + "/sleep", params={"level": 2}).json()
        assert slept["is_sleeping"] and slept["level"] == 2 and slept["freed_bytes"]["kv_cache_bytes"] > 0
        assert httpx.get(srv.url + "/is_sleeping").json() == {"is_sleeping": True}
        assert httpx.post(srv.url + "/sleep", params={"level": 3}).status_code in (400, 422)
        answer = {}
        waiting = threading.Thread(target=lambda: answer.update(
            httpx.post(srv.base_url + "/completions", json=body, timeout=120).json()))
        waiting.start()
        deadline = time.monotonic() + 60
        while (state := httpx.get(srv.base_url + "/engine/state").json())["num_waiting"] != 1:
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        waiting.join(0.5)
        assert waiting.is_alive() and not answer  # held while asleep, not refused
        assert state["sleep_level"] == 2 and state["memory"]["kv_cache_bytes"] == 0
        assert httpx.post(srv.url + "/wake_up").json() == {"is_sleeping": False}
        waiting.join(60)
        assert answer["choices"][0]["text"] == awake
        assert httpx.get(srv.url + "/is_sleeping").json() == {"is_sleeping": False}
        assert f'pagedesk:engine_sleep_level{{model_name="{MODEL_NAME}"}} 0.0' in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()


def test_a_speculating_engine_sleeps_and_wakes(llama_dir):
    """With a draft model (here the model itself) the target frees its memory; the draft's stays (said in the log)."""
    spec = {"model": str(llama_dir), "num_speculative_tokens": 2}
    llm = LLM(str(llama_dir), device="cpu", num_gpu_blocks_override=32, max_num_seqs=2, speculative_config=spec)
    before = greedy(llm)
    llm.sleep(2)
    llm.wake_up()
    assert greedy(llm) == before


@pytest.mark.parametrize("variant", [("awq", 4, 64, False, False), ("gptq", 4, 128, True, True),
                                     ("fp8", 8, -1, True, False)], ids=["awq", "gptq-act-order", "fp8"])
def test_a_quantized_model_reloads_after_a_level_2_sleep(tiny_model_dir, tmp_path, variant):
    """Level 2 reloads the checkpoint through the family's load_weights into the emptied parameters: packed
    weights, scales, zero points and act-order indices come back as they were loaded the first time."""
    from quant_packers import make_quantized
    path = make_quantized(tiny_model_dir("llama", hidden_size=128, intermediate_size=256), tmp_path / "q", *variant)
    llm = LLM(str(path), device="cpu", num_gpu_blocks_override=32, max_num_seqs=2)
    before = greedy(llm)
    state = {k: v.clone() for k, v in llm.engine.runner.model.state_dict().items()}
    llm.sleep(2)
    llm.wake_up()
    after = llm.engine.runner.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items())
    assert greedy(llm) == before


def test_async_scheduling_finishes_the_step_in_flight_before_sleeping(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    expected = greedy(LLM(path, device="cpu", num_gpu_blocks_override=32, max_num_seqs=2))
    llm = LLM(path, device="cpu", num_gpu_blocks_override=32, max_num_seqs=2, async_scheduling=True)
    engine = llm.engine
    assert engine.async_scheduling
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    outputs = {}
    for _ in range(3):
        outputs.update((o.request_id, o) for o in engine.step())
    assert engine.inflight is not None
    llm.sleep(1)
    assert engine.inflight is None and engine.held_outputs
    outputs.update((o.request_id, o) for o in engine.step())  # the held outputs, once
    assert not engine.held_outputs and engine.step() == []
    llm.wake_up()
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    assert [outputs[str(i)].outputs[0].token_ids for i in range(2)] == expected
