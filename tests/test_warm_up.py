"""Start-up compilation of the Triton variants: one forward per distinct kernel configuration, decode batches
and a short prefill chunk across the context ladder, with no K/V written; under tensor parallel every rank
captures and warms up the same shapes whatever its card."""
from __future__ import annotations

import torch

from engine import LLM
from engine.worker.graphs.decode import context_buckets
from engine.worker.graphs.dispatch import every_shape
from engine.worker.warm_up import kernel_shapes, warm_up_kernels


def test_one_shape_per_kernel_configuration():
    # Key: decode vs prefill, and a split count of 2 for one sequence over 1024 tokens of context.
    key = lambda tokens, seqs, width: (tokens == seqs, seqs == 1 and width > 1024)  # noqa: E731
    assert kernel_shapes(4, 4096, 16, key) == [(1, 1, 512), (1, 1, 2048), (1, 16, 512), (1, 16, 2048)]
    assert len(kernel_shapes(4, 4096, 16, every_shape)) == 3 * 4 + 2 * 4  # batches 1, 2, 4 × contexts + 2 prefills


def test_warm_up_runs_the_model_without_writing_the_cache(llama_dir):
    runner = LLM(str(llama_dir), device="cpu").engine.runner
    before = runner.kv_cache.clone()
    calls = []
    forward = runner.model.forward
    runner.model.forward = lambda ids, pos, meta: calls.append((len(ids), meta.max_seq_len)) or \
        forward(ids, pos, meta)
    ran = warm_up_kernels(runner.model, 2, 512, 16, runner.device, lambda t, s, w: (t, s))
    assert ran == 4 and calls == [(1, 512), (2, 512), (16, 512), (32, 512)]
    assert torch.equal(runner.kv_cache, before)


def test_tensor_parallel_ranks_capture_the_same_graphs():
    assert context_buckets(1, 8192, 16, every_shape) == [512, 1024, 2048, 4096, 8192]
