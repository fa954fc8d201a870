"""Greedy decoding on the GPU against HF transformers on the same weights (bf16), and CUDA graphs on vs off."""
from __future__ import annotations

import pytest
import torch

from gpu_reference import greedy_tokens, hf_agreement
from hf_reference import MAX_TOKENS, make_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2"])
def test_bf16_greedy_agrees_with_hf(tiny_model_dir, make_llm, arch):
    path = tiny_model_dir(arch)
    prompts = make_prompts(400)
    outputs = greedy_tokens(make_llm(path, dtype="bfloat16", num_gpu_blocks_override=256), prompts, MAX_TOKENS)
    agreement, first = hf_agreement(path, prompts, outputs, torch.bfloat16)
    print(f"{arch}: {agreement:.2%} of tokens identical to HF's bf16 argmax; first divergence: {first}")
    assert agreement >= 0.99, f"{agreement:.2%} < 99%; first divergence: {first}"


def test_cuda_graphs_on_and_off_give_identical_tokens(tiny_model_dir, make_llm):
    path = tiny_model_dir("llama")
    prompts = make_prompts(400)
    flags = dict(dtype="float32", num_gpu_blocks_override=256)
    eager = greedy_tokens(make_llm(path, enforce_eager=True, **flags), prompts, MAX_TOKENS)
    llm = make_llm(path, enforce_eager=False, **flags)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs, "no graph was captured"
    assert greedy_tokens(llm, prompts, MAX_TOKENS) == eager


def test_triton_and_torch_backends_generate_the_same_tokens(tiny_model_dir, make_llm):
    path = tiny_model_dir("qwen3")
    prompts = make_prompts(400)
    flags = dict(dtype="float32", num_gpu_blocks_override=256, enforce_eager=True)
    assert greedy_tokens(make_llm(path, attention_backend="triton", **flags), prompts, MAX_TOKENS) == \
        greedy_tokens(make_llm(path, attention_backend="torch", **flags), prompts, MAX_TOKENS)
