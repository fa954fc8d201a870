"""The GPU suite (installer/gpu-check.sh): every test is marked `gpu` and skips without CUDA.

Imports only torch, transformers and engine/kernels pieces: the GPU machine has no Qt and no web stack.
Engines are made and dropped per test (`make_llm`), and the card's cache emptied after each, so every
engine sizes itself against a card that holds nothing of the previous one.
"""
from __future__ import annotations

import gc

import pytest
import torch

import engine  # noqa: F401  (sets CUDA_DEVICE_ORDER=PCI_BUS_ID before any test or skipif starts CUDA)


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run installer/gpu-check.sh on a machine with one")
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def make_llm():
    """make_llm(path, **engine flags) -> LLM on cuda; shut down after the test."""
    from engine import LLM
    made = []

    def make(path, **kwargs):
        kwargs = {"device": "cuda", "max_num_seqs": 16, **kwargs}
        llm = LLM(str(path), **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.runner.shutdown()
    made.clear()
