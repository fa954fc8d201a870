"""Tensor parallel over two real cards (NCCL, with the P2P copy test deciding NCCL_P2P_DISABLE): the same
greedy tokens as one card."""
from __future__ import annotations

import pytest
import torch

from gpu_reference import greedy_tokens
from hf_reference import MAX_TOKENS, make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_tp2_matches_one_card(tiny_model_dir, make_llm, enforce_eager):
    path = tiny_model_dir("llama")
    prompts = make_prompts(400)
    flags = dict(dtype="float32", num_gpu_blocks_override=256, enforce_eager=enforce_eager)
    one = greedy_tokens(make_llm(path, **flags), prompts, MAX_TOKENS)
    torch.cuda.empty_cache()
    assert greedy_tokens(make_llm(path, tensor_parallel_size=2, **flags), prompts, MAX_TOKENS) == one
