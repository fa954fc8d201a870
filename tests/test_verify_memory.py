"""A speculative verify step in the memory plan (issue 32 item 2): a verify step has up to max_num_seqs × (1 + k)
logits rows, and the KV sizing used to profile (and the planner to count) max_num_seqs of them: about 4.5 GB of
rejection-sampler temporaries at 256 sequences, k = 4 and a 152k vocabulary against ~1.4 GB profiled. The
profiling step now samples a verify step at `sampler_rows(max_num_seqs, tokens, k)` rows through the rejection
sampler, the planner counts the same rows, and k travels from the engine's start-up (and the router's placement)
to both."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM
from engine.config.model import ModelConfig
from engine.planning.activations import VERIFY_BYTES_PER_LOGIT, forward_activation_bytes, sampler_bytes, sampler_rows
from engine.planning.planner import estimate_profile
from engine.planning.vision import tower_peak_over_forward
from live_bytes import LiveBytes

QWEN_7B = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                      num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=32768)


def test_the_planner_counts_a_verify_steps_rows():
    plain = estimate_profile(QWEN_7B, 24 * 2**30, dtype_bytes=2, tensor_parallel_size=1, max_num_batched_tokens=8192,
                             max_num_seqs=256)
    spec = estimate_profile(QWEN_7B, 24 * 2**30, dtype_bytes=2, tensor_parallel_size=1, max_num_batched_tokens=8192,
                            max_num_seqs=256, num_speculative_tokens=4)
    forward = forward_activation_bytes(QWEN_7B, 8192, 2)
    assert plain.activation_bytes == forward + sampler_bytes(256, QWEN_7B.vocab_size)
    assert spec.activation_bytes == forward + sampler_bytes(256 * 5, QWEN_7B.vocab_size, verify=True)
    print(f"Qwen2.5-7B, 256 sequences: sampler {(plain.activation_bytes - forward) / 2**30:.1f} GiB, "
          f"verify step at k = 4 {(spec.activation_bytes - forward) / 2**30:.1f} GiB")


def test_the_profile_samples_a_verify_step_of_one_plus_k_rows(llama_dir, monkeypatch):
    import engine.worker.model_runner as model_runner
    runner = LLM(str(llama_dir), device="cpu", max_num_seqs=4).engine.runner
    pool, seen = runner.kv_cache, []
    sample = model_runner.sample
    monkeypatch.setattr(model_runner, "sample", lambda logits, batch: seen.append((logits.shape[0], batch)) or
                        sample(logits, batch))
    runner.profile_run(64, 4, torch.float32, 3)  # 4 sequences verifying 3 drafts each: 16 rows
    runner.allocate_kv_cache(pool.shape[2], pool.dtype)
    (rows, batch), = seen
    assert rows == sampler_rows(4, 64, 3) == 16 and not batch.rows
    assert batch.spec.draft_token_ids == [[0] * 3] * 4
    assert batch.spec.draft_probs.shape == (12, runner.config.vocab_size)
    runner.profile_run(10, 4, torch.float32, 3)  # a budget of 10 tokens: 10 rows, the last sequence short
    assert seen[-1][0] == 10 and seen[-1][1].spec.draft_token_ids == [[0] * 3, [0] * 3, [0]]


@pytest.mark.parametrize("draft", [False, True])
def test_the_rejection_sampler_stays_within_the_planned_bytes_per_logit(draft):
    """The planner's VERIFY_BYTES_PER_LOGIT bounds the rejection sampler at the widest parameters (penalties,
    filters, logprobs, a bitmask on every row), a draft model's q included: so counting a verify step's rows
    is counting its memory."""
    from engine.worker.profiling import profile_verify_batch
    from engine.worker.sampling import sample
    vocab, seqs, k = 16384, 16, 3
    rows = seqs * (1 + k)
    logits = torch.randn(rows, vocab)
    batch = profile_verify_batch(rows, k, vocab, torch.device("cpu"))
    if not draft:
        batch.spec.draft_probs, batch.spec.q_index = None, []
    with LiveBytes() as meter:
        if draft:  # the draft's q is made during the step
            batch.spec.draft_probs = batch.spec.draft_probs.clone()
        out = sample(logits, batch)
    assert [len(t) for t in out.spec.token_ids] == [n + 1 for n in out.spec.num_accepted]
    per_logit = meter.peak / (rows * vocab)
    print(f"rejection sampler{' with q' if draft else ''}: {per_logit:.1f} bytes per logit")
    assert per_logit <= VERIFY_BYTES_PER_LOGIT - 4  # the step's fp32 logits themselves are the other 4


def test_a_vl_models_verify_step_counts_the_towers_peak_too():
    """Speculative decoding on a vision-language model: the plan holds the verify step's rows and the tower's peak
    at the largest image above the forward's, both."""
    from test_model_families import GEMMA3_27B
    cfg = ModelConfig.from_hf_config(json.loads(json.dumps(GEMMA3_27B)))
    spec = estimate_profile(cfg, 24 * 2**30, dtype_bytes=2, tensor_parallel_size=1, max_num_batched_tokens=256,
                            max_num_seqs=32, num_speculative_tokens=4)
    forward = forward_activation_bytes(cfg, 256, 2)
    tower = tower_peak_over_forward(cfg, forward, 2)
    assert tower > 0  # SigLIP at 4096 patches tops a 256-token forward
    assert spec.activation_bytes == forward + sampler_bytes(sampler_rows(32, 256, 4), cfg.vocab_size, verify=True) \
        + tower
