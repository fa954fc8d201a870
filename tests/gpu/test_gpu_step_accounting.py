"""Issue 19 on the card: every sequence counted against max_num_seqs under load (n=4, beams, prefix hits,
preemption, CUDA graphs), a head_dim-128 model with a 32k+ vocabulary whose full sampling step stays within
what profiling measured, the CUDA context not counted as other programs, and, with two cards, no context
left on card 1 by the peer probe and a stopped worker found by its heartbeat. Figures are printed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine import SamplingParams
from engine.core.beam_search import BeamSearchParams

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def watch_steps(llm) -> list[tuple[int, int]]:
    engine, seen = llm.engine, []
    execute = engine.runner.execute

    def counting(batch, block_copies, sampling=None):
        rows = 0 if sampling is None else len(sampling.rows) + len(sampling.beam_index)
        seen.append((len(engine.scheduler.running), rows))
        return execute(batch, block_copies, sampling)

    engine.runner.execute = counting
    return seen


def test_n4_streams_with_prefix_hits_and_preemption_stay_within_max_num_seqs(tiny_model_dir, make_llm):
    path = tiny_model_dir("llama", max_position_embeddings=1024)
    llm = make_llm(path, dtype="bfloat16", max_num_seqs=16, num_gpu_blocks_override=48, max_model_len=512)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs  # captured
    seen = watch_steps(llm)
    shared = [7 + i % 50 for i in range(48)]  # a common prefix: hits after the first request
    prompts = [shared + [100 + i, 101 + i] for i in range(64)]
    params = [SamplingParams(n=4, temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(64)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.get_stats()
    print(f"steps {len(seen)}, max running {max(r for r, _ in seen)}, max rows {max(r for _, r in seen)}, "
          f"preemptions {stats.num_preemptions}, prefix hits {stats.prefix_cache_hits}/{stats.prefix_cache_queries}")
    assert max(r for r, _ in seen) <= 16 and max(r for _, r in seen) <= 16
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert all(len(o.outputs) == 4 and all(len(c.token_ids) == 24 for c in o.outputs) for o in outs)
    for i in (0, 31, 63):  # seeded outputs do not depend on the batch around them
        alone = llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0]
        assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in outs[i].outputs]
    seen.clear()
    llm.beam_search(prompts[:6], BeamSearchParams(beam_width=4, max_tokens=8), use_tqdm=False)
    assert max(r for r, _ in seen) <= 16


def test_head_dim_128_with_a_large_vocabulary_fits_what_profiling_measured(tiny_model_dir, make_llm):
    path = tiny_model_dir("llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                          intermediate_size=512, vocab_size=65536, max_position_embeddings=2048)
    rows = 64
    llm = make_llm(path, dtype="bfloat16", max_num_seqs=rows, max_model_len=2048, max_num_batched_tokens=2048,
                   gpu_memory_utilization=0.3)
    runner = llm.engine.runner
    assert runner.model.attention_layers()[0].head_dim == 128
    profile = runner.profile_memory(2048, rows, runner.kv_cache.dtype)[0]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, logprobs=20,
                            allowed_token_ids=list(range(0, 65536, 7)), max_tokens=2)
    for i in range(rows):
        llm.engine.add_request(str(i), [1 + (i * 13 + j) % 400 for j in range(32)], params)  # 64 × 32 = 2048
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    llm.engine.step()  # every prompt whole, every row sampled through a bitmask
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated() - base
    print(f"full step peak {step_peak / 2**20:.1f} MiB, profiled activations {profile.activation_bytes / 2**20:.1f} MiB")
    assert len(llm.engine.scheduler.running) == rows
    assert step_peak <= profile.activation_bytes + 8 * 2**20


def test_cuda_context_is_not_other_programs():
    """In a fresh process: the baseline is the free memory before the context, about its size above torch's."""
    code = ("import torch; from engine import gpu_baseline; free, _ = gpu_baseline.free_bytes_at_start(0); "
            "now, _ = torch.cuda.mem_get_info(0); print(free - now)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    context = int(done.stdout.strip().splitlines()[-1])
    print(f"CUDA context: {context / 2**20:.0f} MiB, not counted as other programs")
    assert context >= 64 * 2**20


two_cards = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                               reason="needs two CUDA GPUs")


@two_cards
def test_peer_probe_leaves_no_context_on_card_1(tmp_path):
    code = ("import os, pynvml; from engine.distributed.peer_access import PeerAccessCache; "
            "c = PeerAccessCache(2); pynvml.nvmlInit(); import torch; "
            "h = pynvml.nvmlDeviceGetHandleByUUID('GPU-' + str(torch.cuda.get_device_properties(1).uuid).removeprefix('GPU-')); "
            "print(c(0, 1), c(1, 0), os.getpid() in [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)])")
    env = {**os.environ, "PYTHONPATH": ROOT, "PAGEDESK_CACHE_DIR": str(tmp_path)}
    for _ in range(2):  # probed, then from the cache file
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env=env)
        assert done.returncode == 0, done.stderr
        print("P2P 0->1, 1->0, context on card 1:", done.stdout.strip())
        assert done.stdout.split()[-1] == "False"
    assert (tmp_path / "peer_access.json").exists()


@two_cards
def test_stopped_worker_is_found_by_its_heartbeat(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir("llama"), dtype="bfloat16", tensor_parallel_size=2, num_gpu_blocks_override=64)
    executor = llm.engine.runner
    pid = executor.worker_pids[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        while executor.liveness_problem() is None and time.monotonic() - start < 10:
            time.sleep(0.2)
        print(f"heartbeat stall noticed after {time.monotonic() - start:.1f} s")
        assert executor.liveness_problem() is not None
    finally:
        os.kill(pid, signal.SIGCONT)
