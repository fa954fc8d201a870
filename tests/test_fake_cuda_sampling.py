"""The sampling side of a CUDA step on fake tensors (see tests/test_fake_cuda.py for the fixture): prompt
logprobs, a structured-output bitmask filled on the host, and the vocab-parallel embedding / LM head of a
tensor-parallel rank all stay on the card; a CPU tensor meeting a CUDA one raises here as on a real card.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.layers.embedding as embedding
from engine.sample.metadata import SamplingBatch
from engine.sample.sampling_params import SamplingParams
from engine.structured_output.bitmask import grammar_bitmask
from test_fake_cuda import (CUDA, cuda_generator, fake_cuda, fake_runner, rows_for,  # noqa: F401 (fixtures)
                            step_inputs, tiny_weights)

pytestmark = pytest.mark.fake_cuda


def test_prompt_logprobs_and_a_host_bitmask_on_cuda(tiny_weights, fake_cuda, monkeypatch):  # noqa: F811
    runner = fake_runner(monkeypatch, fake_cuda, tiny_weights, torch.float16)
    vocab = runner.config.vocab_size
    params = [SamplingParams(temperature=0.8, seed=3, allowed_token_ids=[5, 40]),
              SamplingParams(temperature=0, logprobs=1)]
    # The engine fills the bitmask on the host (xgrammar writes CPU memory); the runner moves it to the card.
    bitmask = grammar_bitmask([None, None], vocab, [p.allowed_token_ids for p in params])
    assert bitmask.device.type == "cpu"
    batch = SamplingBatch(rows_for(params, [cuda_generator(), None]), logits_index=[0, 1],
                          generator=cuda_generator(), bitmask=bitmask)
    inputs = dataclasses.replace(step_inputs(), prompt_logits_rows=[0, 1, 3], prompt_targets=[2, 3, 5],
                                 prompt_logprobs_k=2)
    out = runner.run(inputs, batch)
    assert fake_cuda.host_copies == 2  # one for the sampled tokens, one for the prompt logprobs' slice
    assert len(out.sampled.token_ids) == 2 and out.sampled.top_ids is not None
    lp = out.prompt_logprobs
    assert len(lp.logprobs) == len(lp.ranks) == 3 and [len(t) for t in lp.top_ids] == [2, 2, 2]


@pytest.mark.parametrize("vocab", [64, 67])  # 67: the last rank's slice is zero-padded
def test_vocab_parallel_embedding_and_lm_head_of_a_second_rank_on_cuda(fake_cuda, monkeypatch, vocab):  # noqa: F811
    collectives = []

    def all_reduce(x):
        collectives.append(("all_reduce", x.device))
        return x

    def all_gather_last_dim(x):
        collectives.append(("all_gather", x.device))
        return torch.cat([x, x], dim=-1)

    monkeypatch.setattr(embedding, "get_tp_size", lambda: 2)
    monkeypatch.setattr(embedding, "get_tp_rank", lambda: 1)
    monkeypatch.setattr(embedding, "all_reduce", all_reduce)
    monkeypatch.setattr(embedding, "all_gather_last_dim", all_gather_last_dim)
    with torch.device(CUDA):
        lm_head = embedding.ParallelLMHead(vocab, 16)
    assert lm_head.shard_size == (vocab + 1) // 2 and lm_head.vocab_start == lm_head.shard_size
    input_ids = torch.tensor([0, vocab // 2, vocab - 1], device=CUDA)
    hidden = lm_head(input_ids)
    logits = lm_head.logits(hidden)
    assert hidden.device == logits.device == CUDA and logits.shape == (3, vocab)
    assert collectives == [("all_reduce", CUDA), ("all_gather", CUDA)]
