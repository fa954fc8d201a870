"""Hybrid linear attention on a card: the tiny Qwen3-Next / Qwen3.5 / Qwen3.5-MoE in bf16 with a float32
recurrent state against HF's bf16 argmax, and the Triton DeltaNet kernels against the torch reference path
(float32: the same tokens), with prompts chunked so chunks continue states."""
from __future__ import annotations

import pytest
import torch

from gpu_reference import greedy_tokens, hf_agreement
from hf_reference import MAX_TOKENS, make_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_hybrid_bf16_greedy_agrees_with_hf(tiny_model_dir, make_llm, arch):
    path = tiny_model_dir(arch)
    prompts = make_prompts(400)
    llm = make_llm(path, dtype="bfloat16", num_gpu_blocks_override=256, max_num_seqs=16)
    assert all(ssm.dtype == torch.float32 and conv.dtype == torch.bfloat16
               for conv, ssm in llm.engine.runner.state_cache)
    outputs = greedy_tokens(llm, prompts, MAX_TOKENS)
    agreement, first = hf_agreement(path, prompts, outputs, torch.bfloat16)
    print(f"{arch}: {agreement:.2%} of tokens identical to HF's bf16 argmax; first divergence: {first}")
    assert agreement >= 0.99, f"{agreement:.2%} < 99%; first divergence: {first}"


def test_hybrid_triton_and_torch_kernels_generate_the_same_tokens(tiny_model_dir, make_llm):
    path = tiny_model_dir("qwen3_5")
    prompts = make_prompts(400)
    flags = dict(dtype="float32", num_gpu_blocks_override=256, max_num_seqs=16, max_num_batched_tokens=48)
    assert greedy_tokens(make_llm(path, attention_backend="triton", **flags), prompts, MAX_TOKENS) == \
        greedy_tokens(make_llm(path, attention_backend="torch", **flags), prompts, MAX_TOKENS)
