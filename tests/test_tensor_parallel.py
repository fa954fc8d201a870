"""Tensor parallel on CPU (gloo, two processes): identical greedy output, and no hang or orphan on any failure.

Every engine here spawns one worker process (importing torch takes seconds on a small machine), so each
test builds as few engines as it can and uses tiny models and few tokens.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from engine import LLM, SamplingParams
from engine.executor.tp_executor import check_tensor_parallel
from engine.config.model import ModelConfig
from engine.distributed.peer_access import nccl_environment
from hf_reference import hf_greedy, make_prompts
from tiny_models import ARCHS

pytestmark = pytest.mark.timeout(120)

PROMPT_IDS = [1, 3, 4, 6]  # 3, 16, 17 and 120 tokens: inside a block, at and past a boundary, several blocks
MAX_TOKENS = [10, 12, 6, 8]


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for a reaper does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.parametrize("arch,overrides", [(arch, {}) for arch in ARCHS] + [("llama", {"num_key_value_heads": 1})],
                         ids=list(ARCHS) + ["llama-1kv"])
def test_tp2_greedy_matches_tp1_and_hf(tiny_model_dir, arch, overrides):
    """Column/row-parallel layers, vocab-parallel embedding and LM head (tied on qwen2), KV heads split —
    or replicated on both ranks when the model has one KV head."""
    path = tiny_model_dir(arch, **overrides)
    prompts = [make_prompts(400)[i] for i in PROMPT_IDS]
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    single = LLM(str(path), device="cpu")
    assert greedy(single, prompts) == expected
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2)
    try:
        (worker,) = llm.engine.runner.workers
        assert alive(worker.process.pid)
        # Each rank holds only its shard: about half the weights (norms, replicated KV heads: a bit more).
        whole = single.engine.runner.weights_bytes()
        for shard in [llm.engine.runner.weights_bytes(), *llm.engine.runner.worker_weights_bytes]:
            assert whole / 2 <= shard < whole * 0.6
        assert greedy(llm, prompts) == expected
    finally:
        llm.engine.shutdown()
    assert not alive(worker.process.pid) and not dist.is_initialized()


def test_killed_worker_fails_fast_without_orphans(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=2)
    engine = llm.engine
    (worker,) = engine.runner.workers
    pid = worker.process.pid
    for i in range(4):
        engine.add_request(str(i), make_prompts(400, seed=i)[5], SamplingParams(temperature=0, max_tokens=200))
    for _ in range(3):
        engine.step()
    # The kill lands inside a step: after rank 0 sent the step to the worker, before rank 0's own forward
    # meets it in the collectives (an event in the step, not a timer racing it).
    rank0_run = engine.runner.runner.run

    def run_after_kill(*args, **kwargs):
        os.kill(pid, signal.SIGKILL)
        return rank0_run(*args, **kwargs)

    engine.runner.runner.run = run_after_kill
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died \(killed by SIGKILL\)") as err:
        while engine.has_unfinished_requests():
            engine.step()
    assert "restart the engine" in str(err.value)
    assert not alive(pid) and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="already failed"):
        engine.runner.execute([], [])
    engine.shutdown()  # still fine after a failure


def test_dropped_engine_ends_its_worker_and_a_new_one_can_start(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=2)
    pid = llm.engine.runner.worker_pids[0]
    with pytest.raises(RuntimeError, match="one per process"):  # before spawning anything
        LLM(str(llama_dir), device="cpu", tensor_parallel_size=2)
    assert alive(pid) and dist.is_initialized()
    del llm
    gc.collect()  # no shutdown(): the executor's finalizer ends the worker and leaves the group
    assert wait_gone([pid], timeout=5.0) == [] and not dist.is_initialized()


PARENT_SCRIPT = textwrap.dedent("""
    import json, sys
    from engine import LLM, SamplingParams
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
    print(json.dumps(llm.engine.runner.worker_pids), flush=True)
    while True:  # keep the group busy in collectives until we are killed
        llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
""")


def test_sigkilled_parent_leaves_no_orphan(llama_dir):
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT, str(llama_dir)], stdout=subprocess.PIPE,
                              env=env, cwd=repo, text=True)
    try:
        line = parent.stdout.readline()
        assert line, "the engine subprocess died before reporting its workers"
        worker_pids = json.loads(line)
        time.sleep(0.5)  # mid-generation
        family = descendants(parent.pid)  # the workers and multiprocessing's resource tracker
        assert set(worker_pids) <= set(family)
        parent.kill()
        parent.wait(timeout=10)
        assert wait_gone(family, timeout=8.0) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_tensor_parallel_size_must_divide_heads(llama_dir):
    cfg = ModelConfig.from_folder(llama_dir)  # 4 heads, 2 KV heads
    check_tensor_parallel(cfg, 2)
    check_tensor_parallel(cfg, 4)  # 4 ranks: each KV head on two ranks
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="does not divide"):
        LLM(str(llama_dir), device="cpu", tensor_parallel_size=3)  # fails before spawning anything


def test_no_peer_access_disables_nccl_p2p(caplog):
    assert nccl_environment(2, lambda a, b: True, {}) == {}
    with caplog.at_level("WARNING", logger="pagedesk.engine"):
        assert nccl_environment(2, lambda a, b: False, {}) == {"NCCL_P2P_DISABLE": "1"}
    assert "cuda:0->cuda:1" in caplog.text and "NCCL_P2P_DISABLE=1" in caplog.text
    assert nccl_environment(2, lambda a, b: False, {"NCCL_P2P_DISABLE": "0"}) == {}  # the user's choice wins
    assert nccl_environment(1, lambda a, b: False, {}) == {}
